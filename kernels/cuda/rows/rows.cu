// Instantiations of the row kernels (rows/rows.cuh) on f32 storage.
#include "rows/rows.cuh"

extern "C" __global__ void __launch_bounds__(rows::THREADS)
    stream_means_f32(const float* streams, float* out, rows::StreamMeansParams p) {
    rows::stream_means(streams, out, p);
}

extern "C" __global__ void __launch_bounds__(rows::THREADS) scale_round_f32(float* x, rows::ScaleParams p) {
    rows::scale_round(x, p);
}

extern "C" __global__ void __launch_bounds__(rows::THREADS) exp_std_f32(float* x, unsigned long long n) {
    rows::exp_std_in_place(x, n);
}

extern "C" __global__ void __launch_bounds__(rows::THREADS)
    gated_pool_f32(const unsigned long long* members, float* out, rows::PoolParams p) {
    rows::gated_pool(members, out, p);
}

extern "C" __global__ void __launch_bounds__(rows::INJECT_THREADS)
    engram_inject_f32(float* streams, const float* kv, const float* weight, const u32_t* live,
                      rows::InjectParams p) {
    rows::engram_inject(streams, kv, weight, live, p);
}
