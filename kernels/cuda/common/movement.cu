// Data movement between ops on f32 storage, so activations never leave the device: gathering
// fixed-width pieces from anywhere in device memory (rows, column groups, interleavings),
// widening bf16 GEMM outputs to f32 storage, writing selected key rows into attention lists, and
// the drafter's one elementwise sum.
#include "common/params.h"

// Up to GATHER_INLINE piece addresses passed in the kernel parameters (mirrored by
// kernels/src/ops/movement.rs): a small gather needs no upload of its table.
constexpr unsigned int GATHER_INLINE = 128;
struct InlinePieces {
    unsigned long long pieces[GATHER_INLINE];
};

// out[p * width + c] = pieces[p][c]: `pieces` holds one device address per piece (width floats);
// a null `pieces` means the first n_pieces (<= GATHER_INLINE) addresses of `inline_pieces`.
// Blocks stride over the pieces, threads over a piece's values.
extern "C" __global__ void __launch_bounds__(256)
gather_ptrs_f32(const unsigned long long* pieces, InlinePieces inline_pieces, float* out, unsigned int width,
                unsigned int n_pieces) {
    for (unsigned int p = blockIdx.x; p < n_pieces; p += gridDim.x) {
        const float* src = reinterpret_cast<const float*>(pieces != nullptr ? pieces[p] : inline_pieces.pieces[p]);
        for (unsigned int c = threadIdx.x; c < width; c += blockDim.x) {
            out[static_cast<size_t>(p) * width + c] = src[c];
        }
    }
}

// out[i] = float(x[i]) for bf16 bits x (exact).
extern "C" __global__ void __launch_bounds__(256)
bf16_to_f32(const unsigned short* x, float* out, unsigned long long n) {
    for (unsigned long long i = blockIdx.x * static_cast<unsigned long long>(blockDim.x) + threadIdx.x;
         i < n; i += static_cast<unsigned long long>(gridDim.x) * blockDim.x) {
        out[i] = __uint_as_float(static_cast<unsigned int>(x[i]) << 16);
    }
}

// One query's selected key rows (see `ops::attention::SelectedRows`).
struct SelectedRows {
    unsigned int dst;
    unsigned int count;
    unsigned int base;
    unsigned int reserved;
    unsigned long long src;
};

// key_rows[plan[p].dst + i] = plan[p].base + src[i] for i < plan[p].count, where src is the
// device address of a row of selected positions (u32): a query's selected compressed keys written
// into its key list, as rows of the key table. Blocks stride over the plan.
extern "C" __global__ void __launch_bounds__(256)
compose_selected_rows(const SelectedRows* plan, unsigned int n_plan, unsigned int* key_rows) {
    for (unsigned int p = blockIdx.x; p < n_plan; p += gridDim.x) {
        const SelectedRows entry = plan[p];
        const unsigned int* src = reinterpret_cast<const unsigned int*>(entry.src);
        for (unsigned int i = threadIdx.x; i < entry.count; i += blockDim.x) {
            key_rows[entry.dst + i] = entry.base + src[i];
        }
    }
}

// x[i] += y[i] in fp32 (the drafter's Markov bias added to its base logits).
extern "C" __global__ void __launch_bounds__(256)
add_f32(float* x, const float* y, unsigned long long n) {
    for (unsigned long long i = blockIdx.x * static_cast<unsigned long long>(blockDim.x) + threadIdx.x;
         i < n; i += static_cast<unsigned long long>(gridDim.x) * blockDim.x) {
        x[i] += y[i];
    }
}
