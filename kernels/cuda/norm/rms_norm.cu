// RMSNorm instantiation: bf16 in, bf16 weight, bf16 out, fp32 math.
#include "norm/rms_norm.cuh"

extern "C" __global__ void __launch_bounds__(rmsnorm::THREADS)
    rms_norm_bf16(const __nv_bfloat16* x, const __nv_bfloat16* w, __nv_bfloat16* y, RmsNormParams p) {
    rmsnorm::rms_norm<__nv_bfloat16>(x, w, y, p);
}
