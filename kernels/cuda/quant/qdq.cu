// Instantiations of the in-place QDQ points on f32 storage: Q8, Q4e, Q4m.
#include "common/grid_dependency.cuh"
#include "quant/qdq.cuh"

extern "C" __global__ void __launch_bounds__(qdq::THREADS) q8_qdq_f32(float* x, QdqParams p) {
    grid_dependency_sync();
    qdq::qdq_in_place<qdq::Q8>(x, p);
}

extern "C" __global__ void __launch_bounds__(qdq::THREADS) q4e_qdq_f32(float* x, QdqParams p) {
    grid_dependency_sync();
    qdq::qdq_in_place<qdq::Q4e>(x, p);
}

extern "C" __global__ void __launch_bounds__(qdq::THREADS) q4m_qdq_f32(float* x, QdqParams p) {
    grid_dependency_sync();
    qdq::qdq_in_place<qdq::Q4m>(x, p);
}
