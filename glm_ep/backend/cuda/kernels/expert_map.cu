// Global expert ids -> a placement's physical expert slots: slot s of a call (its flat index t * K + k) that
// chose expert e takes replica s % nrep[e] of e's slots, table[e * width + s % nrep[e]]. One thread a slot;
// out may be ids itself (each thread reads its own id before it writes), so neither pointer is __restrict__.
//
// NumPy twin: map_ids (glm_ep/mlp/expert_map.py); held together by tests/cuda/test_cuda_balance.py.
#include "common.cuh"

#ifndef ELEM_THREADS
#error "ELEM_THREADS is set by glm_ep/backend/cuda/kernel_loader.py"
#endif

extern "C" __global__ void __launch_bounds__(ELEM_THREADS)
map_expert_ids(const int* ids, int* out, int n, const int* __restrict__ table, int width,
               const int* __restrict__ nrep) {
    pdl_enter();
    const int s = blockIdx.x * ELEM_THREADS + threadIdx.x;
    if (s >= n) return;
    const int e = ids[s];
    out[s] = table[(long long)e * width + s % nrep[e]];
}
