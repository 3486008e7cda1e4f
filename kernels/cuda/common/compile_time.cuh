// Numbers known at compile time, for kernels that instantiate one body per count instead of
// looping over a runtime one (so every loop over the count unrolls, with no guard inside).
#pragma once
#include "common/params.h"

// A number known at compile time: a count (of tiles, of mHC streams) or the index of an unrolled
// step.
template <u32_t N>
struct Const {
    static constexpr u32_t value = N;
};

// f(Const<I>{}) for I = FIRST .. N - 1 in order, as straight code: unlike `#pragma unroll`, which
// the compiler may decline for a long body, no loop is left for ptxas to keep.
template <u32_t FIRST, u32_t N, class F>
__device__ __forceinline__ void unrolled(F& f) {
    if constexpr (FIRST < N) {
        f(Const<FIRST>{});
        unrolled<FIRST + 1, N>(f);
    }
}

// f(Const<n>{}) for the runtime n in [FIRST, LAST] (past LAST: LAST): one body, instantiated per
// value.
template <u32_t FIRST, u32_t LAST, class F>
__device__ __forceinline__ void with_const(u32_t n, F&& f) {
    if constexpr (FIRST < LAST) {
        if (n != FIRST) {
            with_const<FIRST + 1, LAST>(n, f);
            return;
        }
    }
    f(Const<FIRST>{});
}
