// Instantiation of the Engram hashing and table lookup.
#include "common/grid_dependency.cuh"
#include "engram/engram.cuh"

extern "C" __global__ void __launch_bounds__(engram::THREADS)
    engram_hash_rows(const unsigned long long* contexts, const unsigned long long* multipliers,
                     const unsigned long long* primes, const unsigned long long* offsets, u32_t* rows,
                     engram::HashParams p) {
    grid_dependency_sync();
    engram::hash_rows(contexts, multipliers, primes, offsets, rows, p);
}

extern "C" __global__ void __launch_bounds__(engram::THREADS)
    engram_gather_f32(const u8_t* codes, const u8_t* scales, const u32_t* ids, float* out, engram::GatherParams p) {
    grid_dependency_sync();
    engram::gather(codes, scales, ids, out, p);
}
