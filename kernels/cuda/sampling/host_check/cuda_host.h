// Host emulation of the CUDA built-ins that sampling.cuh uses, so the kernel's exact logic can be
// checked on a machine without a GPU: one std::thread per CUDA thread, std::barrier for
// __syncthreads and for the warp-synchronous primitives (every call is made by whole warps),
// `__shared__` as function statics (blocks run one after another). IEEE double arithmetic on the
// host (SSE2, -ffp-contract=off) rounds exactly as the __d*_rn / __fma_rn intrinsics do.
#pragma once
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <math.h>
#include <thread>
#include <vector>
#define __device__
#define __global__
#define __forceinline__ inline
#define __restrict__
#define __shared__ static
struct dim3 { unsigned x = 0, y = 0, z = 0; };
inline thread_local dim3 threadIdx;
inline dim3 blockIdx;
struct Emu {
    std::barrier<>* block = nullptr;
    std::vector<std::barrier<>*> warp;
    unsigned long long slots[64][32];
};
inline Emu emu;
inline void __syncthreads() { emu.block->arrive_and_wait(); }
inline void __syncwarp() { emu.warp[threadIdx.x / 32]->arrive_and_wait(); }
template <class T> inline unsigned long long to_bits(T v) { unsigned long long b = 0; std::memcpy(&b, &v, sizeof(T)); return b; }
template <class T> inline T from_bits(unsigned long long b) { T v; std::memcpy(&v, &b, sizeof(T)); return v; }
template <class T> inline T __shfl_down_sync(unsigned, T v, unsigned delta) {
    unsigned w = threadIdx.x / 32, lane = threadIdx.x % 32;
    emu.slots[w][lane] = to_bits(v);
    __syncwarp();
    T r = lane + delta < 32 ? from_bits<T>(emu.slots[w][lane + delta]) : v;
    __syncwarp();
    return r;
}
// Every lane of the warp publishes `v`; the mask of the lanes whose value `chosen` accepts.
template <class Chosen> inline unsigned warp_mask(unsigned long long v, Chosen chosen) {
    unsigned w = threadIdx.x / 32, lane = threadIdx.x % 32;
    emu.slots[w][lane] = v;
    __syncwarp();
    unsigned mask = 0;
    for (unsigned l = 0; l < 32; ++l) if (chosen(emu.slots[w][l])) mask |= 1u << l;
    __syncwarp();
    return mask;
}
inline unsigned __match_any_sync(unsigned, unsigned v) {
    return warp_mask(v, [v](unsigned long long s) { return s == v; });
}
inline unsigned __ballot_sync(unsigned, bool p) {
    return warp_mask(p, [](unsigned long long s) { return s != 0; });
}
inline bool __any_sync(unsigned m, bool p) { return __ballot_sync(m, p) != 0; }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __ffs(unsigned x) { return __builtin_ffs(x); }
inline unsigned atomicAdd(unsigned* p, unsigned v) { return std::atomic_ref<unsigned>(*p).fetch_add(v); }
inline unsigned atomicMin(unsigned* p, unsigned v) {
    std::atomic_ref<unsigned> a(*p);
    unsigned old = a.load();
    while (v < old && !a.compare_exchange_weak(old, v)) {}
    return old;
}
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dsub_rn(double a, double b) { return a - b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline double __ddiv_rn(double a, double b) { return a / b; }
inline double __fma_rn(double a, double b, double c) { return std::fma(a, b, c); }
inline double __longlong_as_double(long long b) { return from_bits<double>((unsigned long long)b); }
inline long long __double_as_longlong(double d) { return (long long)to_bits(d); }
inline unsigned __float_as_uint(float f) { return (unsigned)to_bits(f); }
inline float __uint_as_float(unsigned u) { return from_bits<float>(u); }
inline float __double2float_rn(double d) { return (float)d; }
using std::isnan; using std::isinf; using std::rint; using std::floor;

template <class F> void launch(unsigned grid, unsigned threads, F kernel) {
    for (unsigned b = 0; b < grid; ++b) {
        blockIdx.x = b;
        std::barrier<> block(threads);
        emu.block = &block;
        std::vector<std::barrier<>*> warps;
        for (unsigned w = 0; w < threads / 32; ++w) warps.push_back(new std::barrier<>(32));
        emu.warp = warps;
        std::vector<std::thread> ts;
        for (unsigned t = 0; t < threads; ++t) ts.emplace_back([t, &kernel] { threadIdx.x = t; kernel(); });
        for (auto& t : ts) t.join();
        for (auto* w : warps) delete w;
    }
}
inline bool __all_sync(unsigned m, bool p) { return __ballot_sync(m, p) == 0xffffffffu; }
template <class T> inline T __shfl_up_sync(unsigned, T v, unsigned delta) {
    unsigned w = threadIdx.x / 32, lane = threadIdx.x % 32;
    emu.slots[w][lane] = to_bits(v);
    __syncwarp();
    T r = lane >= delta ? from_bits<T>(emu.slots[w][lane - delta]) : v;
    __syncwarp();
    return r;
}
template <class T> inline T __shfl_sync(unsigned, T v, unsigned src) {
    unsigned w = threadIdx.x / 32, lane = threadIdx.x % 32;
    emu.slots[w][lane] = to_bits(v);
    __syncwarp();
    T r = from_bits<T>(emu.slots[w][src & 31]);
    __syncwarp();
    (void)lane;
    return r;
}
