// Bit-exact scalar numerics of v41-architecture.md §3.0: E4M3/E8M0/E2M1 codecs and the
// power-of-two scale rounding P2. Every function here must agree bit for bit with
// deepinfer-model's quant.rs / weights.rs (the GPU conformance tests check it).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include "common/params.h"

// P2(v): the smallest power of two >= v for a positive normal fp32 v, from the exponent and
// mantissa fields (2^(e - 127 + [m != 0])), with integer operations only.
__device__ __forceinline__ float p2_scale(float v) {
    u32_t bits = __float_as_uint(v);
    u32_t exponent = (bits >> 23) & 0xffu;
    u32_t round_up = (bits & 0x7fffffu) != 0u ? 1u : 0u;
    return __uint_as_float((exponent + round_up) << 23);
}

// E4M3 (OCP "fn") encode with round-to-nearest-even, saturating to +-448 (hardware cvt on sm_89+).
__device__ __forceinline__ u8_t e4m3_encode(float v) {
    return (u8_t)__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3);
}

// E4M3 decode, exact: e4m3 -> f16 is exact (every e4m3 value is an f16 normal), f16 -> f32 exact.
__device__ __forceinline__ float e4m3_decode(u8_t code) {
    __half_raw h = __nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)code, __NV_E4M3);
    return __half2float(__half(h));
}

// Two E4M3 bytes (low byte first) decoded to two floats with one conversion instruction.
__device__ __forceinline__ float2 e4m3x2_decode(u16_t codes) {
    __half2_raw h2 = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)codes, __NV_E4M3);
    return __half22float2(__half2(h2));
}

// UE8M0 scale byte -> 2^(e - 127) (0 -> 2^-127 is subnormal; 255 (NaN) never occurs in checkpoints).
__device__ __forceinline__ float e8m0_decode(u8_t e) {
    if (e == 0u) return __uint_as_float(0x00400000u);
    return __uint_as_float(((u32_t)e) << 23);
}

// E2M1 nibble (bit 3 = sign) -> float, built from bits: code (e, m) with e = bits 2..1 and m = bit 0
// is m * 0.5 for e = 0, else (1 + m/2) * 2^(e-1). Code 8 is -0.
__device__ __forceinline__ float e2m1_decode(u32_t nibble) {
    u32_t e = (nibble >> 1) & 3u;
    u32_t m = nibble & 1u;
    u32_t bits = e != 0u ? (((126u + e) << 23) | (m << 22)) : (m != 0u ? 0x3f000000u : 0u);
    return __uint_as_float(bits | ((nibble & 8u) << 28));
}

// Element conversions used by the dtype-generic templates (one overload per instantiated dtype).
__device__ __forceinline__ float to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }
template <class T> __device__ __forceinline__ T from_f32(float v);
template <>
__device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float v) {
    return __float2bfloat16_rn(v);
}

// The model's host layout keeps bf16 values in f32 storage ("an f32 whose low 16 bits are zero").
// The f32-storage instantiations read f32 as is and round every output to bf16, keeping f32 storage.
__device__ __forceinline__ float to_f32(float v) { return v; }
__device__ __forceinline__ float round_bf16_f32(float v) {
    return __bfloat162float(__float2bfloat16_rn(v));
}
template <>
__device__ __forceinline__ float from_f32<float>(float v) {
    return round_bf16_f32(v);
}
// An output store: rounded to bf16 (ROUND_BF16, any T), or the fp32 value as is (T = float only:
// the ops' fp32 precision, matched against the float32 reference of V4).
template <class T, bool ROUND_BF16>
__device__ __forceinline__ T store_f32(float v) {
    if constexpr (ROUND_BF16) {
        return from_f32<T>(v);
    } else {
        static_assert(sizeof(T) == sizeof(float), "unrounded outputs need f32 storage");
        return v;
    }
}

// Tensor-core helpers of the `fast` kernels (attention/sparse_attention_fast.cuh,
// linear/linear_fast.cuh).
// Two floats as a bf16 pair (lo in the low half), round to nearest even.
__device__ __forceinline__ u32_t pack_bf16(float lo, float hi) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const u32_t*>(&v);
}

// d += a · b on tensor cores: mma.sync m16n8k16, bf16 operands, fp32 accumulation (fragments in
// PTX's m16n8k16 layouts: a rows g and g + 8, k 2q.. and 2q + 8..; b k 2q.., n g).
__device__ __forceinline__ void mma_bf16(float (&d)[4], const u32_t (&a)[4], u32_t b0, u32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Four 8x8 bf16 matrices from shared memory (ldmatrix.x4): lane l gives the address of row l % 8
// of matrix l / 8 (16 bytes, 16-byte aligned) and receives in register i matrix i's elements
// (row l / 4; columns 2 (l % 4), + 1), the lower column in the low half: the mma fragment
// registers of an A tile stored row-major or a B tile stored n-major, the same pairs a 32-bit
// load of the two values gives. `ldmatrix_x4_trans` receives (rows 2 (l % 4), + 1; column l / 4),
// the lower row in the low half: a B tile stored k-major.
__device__ __forceinline__ void ldmatrix_x4(u32_t (&r)[4], const void* row) {
    const u32_t a = (u32_t)__cvta_generic_to_shared(row);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a)
                 : "memory");
}

__device__ __forceinline__ void ldmatrix_x4_trans(u32_t (&r)[4], const void* row) {
    const u32_t a = (u32_t)__cvta_generic_to_shared(row);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a)
                 : "memory");
}

// Asynchronous global -> shared copies (cp.async) of the staged tensor-core kernels
// (gemm/gemm_fast.cuh, linear/linear_fast.cuh, attention/sparse_attention_fast.cuh); an invalid
// copy reads nothing and zero-fills. The destination is a shared-window address
// (__cvta_generic_to_shared), or a pointer converted to one: a kernel that keeps an address adds
// its offsets in 32 bits, and ptxas folds the constant ones into the copy instruction.
__device__ __forceinline__ void cp_async16(u32_t smem, const void* gmem, bool valid) {
    const u32_t bytes = valid ? 16u : 0u;  // 0: zero-fill, nothing read
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem), "l"(gmem), "r"(bytes));
}

__device__ __forceinline__ void cp_async4(u32_t smem, const void* gmem, bool valid) {
    const u32_t bytes = valid ? 4u : 0u;
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem), "l"(gmem), "r"(bytes));
}

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
    cp_async16((u32_t)__cvta_generic_to_shared(smem), gmem, valid);
}

__device__ __forceinline__ void cp_async4(void* smem, const void* gmem, bool valid) {
    cp_async4((u32_t)__cvta_generic_to_shared(smem), gmem, valid);
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int PENDING>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(PENDING));
}
