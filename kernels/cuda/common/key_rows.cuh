// The KeyFetch accessors of the attention and index-score kernels: each maps a key's row number to
// the address of its head_dim floats. The kernels' arithmetic is the same for both.
#pragma once
#include "common/params.h"

namespace keyrows {

// Row r is at keys + r * head_dim of one buffer [rows, head_dim].
struct FlatKeys {
    const float* keys;
    u32_t head_dim;
    __device__ const float* operator()(u32_t row) const { return keys + (size_t)row * head_dim; }
};

// Row r is at the device address ptrs[r] (head_dim floats there; checked by the launcher's table).
struct KeyPointers {
    const unsigned long long* ptrs;
    __device__ const float* operator()(u32_t row) const {
        return reinterpret_cast<const float*>(ptrs[row]);
    }
};

}  // namespace keyrows
