// Instantiation of the MoE router on f32 gate logits.
#include "common/grid_dependency.cuh"
#include "moe/route.cuh"

extern "C" __global__ void __launch_bounds__(moe::THREADS)
    route_experts_f32(const float* logits, const float* bias, const u32_t* forced_ids, u32_t* experts,
                      float* weights, moe::RouteParams p) {
    grid_dependency_sync();
    moe::route_experts(logits, bias, forced_ids, experts, weights, p);
}
