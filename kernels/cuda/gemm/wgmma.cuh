// sm_90a warpgroup MMAs on E4M3 (wgmma.mma_async m64nNk32, fp32 sums): the fast GEMMs' group
// sums on Hopper, whose only native FP8 tensor-core path this is (mma.sync's e4m3 form compiles
// there to an f16 emulation: F2FP conversions, two HMMA.16816 and an FADD per k32).
//
// A (64 x 32: the warpgroup's four warps' 16-row weight bands) comes from registers, where
// wgmma's 8-bit A fragment is, warp by warp, mma.sync m16n8k32's (rows g, g + 8; k 4t .. 4t + 3
// and 16 + 4t .. 16 + 4t + 3). B (32 x N: N token rows, K-major) comes from shared memory
// without swizzle: core matrices of 8 rows x 16 bytes (128 contiguous bytes), the second 16
// codes of K `lbo` bytes after the first, the next 8 rows `sbo` bytes on. The sums d[i][r] are
// the n8 tile i's mma.sync C fragment (rows g, g + 8 of the warp's band; tokens 8i + 2t, + 1).
// Compiled only where __CUDA_ARCH_FEAT_SM90_ALL is defined (sm_90a).
#pragma once
#include "common/numerics.cuh"

namespace wgmma {

// The shared-memory matrix descriptor of a K-major operand without swizzle at `smem`.
__device__ __forceinline__ unsigned long long desc(const void* smem, u32_t lbo, u32_t sbo) {
    const u32_t address = (u32_t)__cvta_generic_to_shared(smem);
    return (unsigned long long)((address >> 4) & 0x3fffu) | ((unsigned long long)((lbo >> 4) & 0x3fffu) << 16) |
           ((unsigned long long)((sbo >> 4) & 0x3fffu) << 32);
}

// This thread's earlier shared-memory writes (cp.async, the generic proxy) before later reads by
// the async proxy (the wgmma's B operand); a barrier then publishes them to the warpgroup.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// The registers the next wgmmas read (A fragments, sums) are written before they issue.
__device__ __forceinline__ void fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// Waits until at most PENDING committed groups are in flight.
template <int PENDING>
__device__ __forceinline__ void wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(PENDING) : "memory");
}

// Pins the sums' registers here: the compiler neither reads them before the wait that precedes
// this nor moves their writes past it (the wgmma writes them asynchronously).
template <int TILES>
__device__ __forceinline__ void pin(float (&d)[TILES][4]) {
#pragma unroll
    for (u32_t i = 0; i < TILES; ++i) {
        asm volatile("" : "+f"(d[i][0]), "+f"(d[i][1]), "+f"(d[i][2]), "+f"(d[i][3])::"memory");
    }
}

// d = A · B (+ d when SCALE_D is 1) for N token rows: E4M3 A fragment `a`, B at descriptor `b`.
// With SCALE_D 0 the sums' inputs are not read (they may hold anything).
template <u32_t N>
struct E4m3;

#define WGMMA_D1(i) "+f"(d[i][0]), "+f"(d[i][1]), "+f"(d[i][2]), "+f"(d[i][3])
#define WGMMA_D2(i) WGMMA_D1(i), WGMMA_D1(i + 1)
#define WGMMA_D4(i) WGMMA_D2(i), WGMMA_D2(i + 2)
#define WGMMA_D8(i) WGMMA_D4(i), WGMMA_D4(i + 4)
#define WGMMA_D16(i) WGMMA_D8(i), WGMMA_D8(i + 8)
// One specialisation: N, the sums' operand list, A's, B's, scale-d's (an immediate), the sums.
#define WGMMA_E4M3(N, D_REGS, A_REGS, B_REG, SCALE_D_REG, ...)                                              \
    template <>                                                                                            \
    struct E4m3<N> {                                                                                       \
        template <int SCALE_D>                                                                             \
        static __device__ __forceinline__ void run(float (&d)[N / 8][4], const u32_t (&a)[4],              \
                                                   unsigned long long b) {                                 \
            asm volatile("wgmma.mma_async.sync.aligned.m64n" #N "k32.f32.e4m3.e4m3 {" D_REGS "}, {" A_REGS \
                         "}, " B_REG ", " SCALE_D_REG ", 1, 1;\n"                                         \
                         : __VA_ARGS__                                                                     \
                         : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "n"(SCALE_D));              \
        }                                                                                                  \
    };

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
WGMMA_E4M3(8,
           "%0, %1, %2, %3",
           "%4, %5, %6, %7", "%8", "%9", WGMMA_D1(0))
WGMMA_E4M3(16,
           "%0, %1, %2, %3, %4, %5, %6, %7",
           "%8, %9, %10, %11", "%12", "%13", WGMMA_D2(0))
WGMMA_E4M3(24,
           "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11",
           "%12, %13, %14, %15", "%16", "%17", WGMMA_D2(0), WGMMA_D1(2))
WGMMA_E4M3(32,
           "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15",
           "%16, %17, %18, %19", "%20", "%21", WGMMA_D4(0))
WGMMA_E4M3(48,
           "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
           "%16, %17, %18, %19, %20, %21, %22, %23",
           "%24, %25, %26, %27", "%28", "%29", WGMMA_D4(0), WGMMA_D2(4))
WGMMA_E4M3(64,
           "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
           "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31",
           "%32, %33, %34, %35", "%36", "%37", WGMMA_D8(0))
WGMMA_E4M3(96,
           "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
           "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
           "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47",
           "%48, %49, %50, %51", "%52", "%53", WGMMA_D8(0), WGMMA_D4(8))
WGMMA_E4M3(128,
           "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
           "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
           "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
           "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63",
           "%64, %65, %66, %67", "%68", "%69", WGMMA_D16(0))
#endif

#undef WGMMA_E4M3
#undef WGMMA_D16
#undef WGMMA_D8
#undef WGMMA_D4
#undef WGMMA_D2
#undef WGMMA_D1

}  // namespace wgmma
