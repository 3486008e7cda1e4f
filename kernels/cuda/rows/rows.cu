// Instantiations of the row kernels (rows/rows.cuh) on f32 storage.
#include "common/grid_dependency.cuh"
#include "rows/rows.cuh"

extern "C" __global__ void __launch_bounds__(rows::THREADS)
    stream_means_f32(const float* streams, float* out, rows::StreamMeansParams p) {
    grid_dependency_sync();
    rows::stream_means(streams, out, p);
}

extern "C" __global__ void __launch_bounds__(rows::THREADS) scale_round_f32(float* x, rows::ScaleParams p) {
    grid_dependency_sync();
    rows::scale_round(x, p);
}

extern "C" __global__ void __launch_bounds__(rows::THREADS) exp_std_f32(float* x, unsigned long long n) {
    grid_dependency_sync();
    rows::exp_std_in_place(x, n);
}

extern "C" __global__ void __launch_bounds__(rows::THREADS)
    gated_pool_f32(const unsigned long long* members, float* out, rows::PoolParams p) {
    grid_dependency_sync();
    rows::gated_pool(members, out, p);
}

extern "C" __global__ void __launch_bounds__(rows::INJECT_THREADS)
    engram_inject_f32(float* streams, const float* kv, const float* weight, const u32_t* live,
                      rows::InjectParams p) {
    grid_dependency_sync();
    rows::engram_inject(streams, kv, weight, live, p);
}
