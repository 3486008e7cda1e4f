// Data movement between ops on f32 storage, so activations never leave the device: gathering
// fixed-width pieces from anywhere in device memory (rows, column groups, interleavings),
// widening bf16 GEMM outputs to f32 storage, writing selected key rows into attention lists, and
// the drafter's one elementwise sum.
#include "common/grid_dependency.cuh"
#include "common/params.h"

// Up to GATHER_INLINE piece addresses passed in the kernel parameters (mirrored by
// kernels/src/ops/movement.rs): a small gather needs no upload of its table.
constexpr unsigned int GATHER_INLINE = 128;
struct InlinePieces {
    unsigned long long pieces[GATHER_INLINE];
};

// out[p * width + c] = pieces[p][c]: `pieces` holds one device address per piece (width floats);
// a null `pieces` means the first n_pieces (<= GATHER_INLINE) addresses of `inline_pieces`.
// Block (x, y) copies columns [x * GATHER_TILE, (x + 1) * GATHER_TILE) of pieces y, y + gridDim.y,
// ...; a thread's GATHER_UNROLL values are all loaded before any is stored, so a wide piece (a
// decode step's mHC streams: 4 x 5120 values) is many blocks of independent loads, not one block's
// chain of dependent ones.
constexpr unsigned int GATHER_UNROLL = 4;
constexpr unsigned int GATHER_THREADS = 256;
constexpr unsigned int GATHER_TILE = GATHER_THREADS * GATHER_UNROLL;
extern "C" __global__ void __launch_bounds__(GATHER_THREADS)
gather_ptrs_f32(const unsigned long long* __restrict__ pieces, InlinePieces inline_pieces,
                float* __restrict__ out, unsigned int width, unsigned int n_pieces) {
    grid_dependency_sync();
    const unsigned int first = blockIdx.x * GATHER_TILE + threadIdx.x;
    for (unsigned int p = blockIdx.y; p < n_pieces; p += gridDim.y) {
        const float* __restrict__ src =
            reinterpret_cast<const float*>(pieces != nullptr ? pieces[p] : inline_pieces.pieces[p]);
        float* __restrict__ dst = out + static_cast<size_t>(p) * width;
        float values[GATHER_UNROLL];
#pragma unroll
        for (unsigned int j = 0; j < GATHER_UNROLL; ++j) {
            const unsigned int c = first + j * GATHER_THREADS;
            values[j] = c < width ? src[c] : 0.0f;
        }
#pragma unroll
        for (unsigned int j = 0; j < GATHER_UNROLL; ++j) {
            const unsigned int c = first + j * GATHER_THREADS;
            if (c < width) dst[c] = values[j];
        }
    }
}

// out[i] = float(x[i]) for bf16 bits x (exact). A thread takes 4 consecutive values (one 8-byte
// load, one 16-byte store: both buffers are whole allocations, so aligned), the last quad's tail
// one by one.
extern "C" __global__ void __launch_bounds__(256)
bf16_to_f32(const unsigned short* x, float* out, unsigned long long n) {
    grid_dependency_sync();
    const unsigned long long quads = n / 4;
    const unsigned long long stride = static_cast<unsigned long long>(gridDim.x) * blockDim.x;
    for (unsigned long long q = blockIdx.x * static_cast<unsigned long long>(blockDim.x) + threadIdx.x; q < quads;
         q += stride) {
        const uint2 v = reinterpret_cast<const uint2*>(x)[q];
        reinterpret_cast<float4*>(out)[q] = make_float4(__uint_as_float(v.x << 16), __uint_as_float(v.x & 0xffff0000u),
                                                        __uint_as_float(v.y << 16), __uint_as_float(v.y & 0xffff0000u));
    }
    const unsigned long long tail = 4 * quads + blockIdx.x * static_cast<unsigned long long>(blockDim.x) + threadIdx.x;
    if (tail < n) out[tail] = __uint_as_float(static_cast<unsigned int>(x[tail]) << 16);
}

// A run of attention key-list positions (see `ops::attention::ListSegment`).
struct ListSegment {
    unsigned int dst;
    unsigned int count;
    unsigned int first;
    unsigned int reserved;
    unsigned long long src;
};

// key_rows[s.dst + i] = s.first + i for a run (s.src == 0), s.first + src[i] for a selection (src:
// the device address of a row of selected positions, u32), i < s.count: a step's attention key
// lists written on the device, the selected compressed keys straight from the top-k. Blocks stride
// over the segments.
extern "C" __global__ void __launch_bounds__(256)
compose_key_lists(const ListSegment* segments, unsigned int n_segments, unsigned int* key_rows) {
    grid_dependency_sync();
    for (unsigned int p = blockIdx.x; p < n_segments; p += gridDim.x) {
        const ListSegment s = segments[p];
        const unsigned int* src = reinterpret_cast<const unsigned int*>(s.src);
        for (unsigned int i = threadIdx.x; i < s.count; i += blockDim.x) {
            key_rows[s.dst + i] = s.first + (src != nullptr ? src[i] : i);
        }
    }
}

// A copy of `count` addresses (see `ops::key_table::AddressCopy`).
struct AddressCopy {
    unsigned long long src;
    unsigned long long dst;
    unsigned int count;
    unsigned int reserved;
};

// Every copy of `copies` (disjoint destinations): a step's key table put together on the device
// from the address lists kept there and the addresses the step uploads. Blocks stride over the
// copies.
extern "C" __global__ void __launch_bounds__(256)
copy_addresses(const AddressCopy* copies, unsigned int n) {
    grid_dependency_sync();
    for (unsigned int p = blockIdx.x; p < n; p += gridDim.x) {
        const AddressCopy c = copies[p];
        const unsigned long long* src = reinterpret_cast<const unsigned long long*>(c.src);
        unsigned long long* dst = reinterpret_cast<unsigned long long*>(c.dst);
        for (unsigned int i = threadIdx.x; i < c.count; i += blockDim.x) dst[i] = src[i];
    }
}

// x[i] += y[i] in fp32 (the drafter's Markov bias added to its base logits).
extern "C" __global__ void __launch_bounds__(256)
add_f32(float* x, const float* y, unsigned long long n) {
    grid_dependency_sync();
    for (unsigned long long i = blockIdx.x * static_cast<unsigned long long>(blockDim.x) + threadIdx.x;
         i < n; i += static_cast<unsigned long long>(gridDim.x) * blockDim.x) {
        x[i] += y[i];
    }
}
