// Instantiations of the mHC kernels on f32 storage, for any number of tokens (grid: see mhc.cuh).
#include "common/grid_dependency.cuh"
#include "mhc/mhc.cuh"

extern "C" __global__ void __launch_bounds__(mhc::PARTIAL_THREADS)
    hc_mixes_partials_f32(const float* x, const float* proj, float* scratch, HcMixesParams p, u32_t tokens) {
    grid_dependency_sync();
    mhc::hc_mixes_partials(x, proj, scratch, p, tokens);
}

extern "C" __global__ void __launch_bounds__(mhc::THREADS)
    hc_mixes_f32(const float* scratch, const float* base, const float* scale, float* out, HcMixesParams p) {
    grid_dependency_sync();
    mhc::hc_mixes(scratch, base, scale, out, p);
}

extern "C" __global__ void hc_collapse_f32(const float* x, const float* w, float* y, HcElementwiseParams p) {
    grid_dependency_sync();
    mhc::hc_collapse(x, w, y, p);
}

extern "C" __global__ void hc_expand_f32(const float* y, const float* residual, const float* mixes, float* out,
                                         HcElementwiseParams p) {
    grid_dependency_sync();
    mhc::hc_expand(y, residual, mixes, out, p);
}
