// On-device routing tables, mirroring glm_ep/routing.py exactly:
//   moe_union_table      the union of a row group's chosen experts in first-occurrence
//                        (row-major) order: u_eid [R*K] (-1 unused), u_slot [R*K, R] (-1: absent)
//   moe_sort_by_expert   a stable counting sort of the flat (row, slot) ids by expert
#include "common.cuh"

#ifndef UNION_MAX_IDS
#error "UNION_MAX_IDS is set by glm_ep/backend/kernels.py"
#endif

// One block of R*K <= UNION_MAX_IDS threads, thread i = (row i / K, slot i % K). Threads past the
// block would never run, so the wrapper refuses a wider group.
extern "C" __global__ void __launch_bounds__(UNION_MAX_IDS)
moe_union_table(const int* __restrict__ ids, int* __restrict__ u_eid, int* __restrict__ u_slot, int R, int K) {
    __shared__ int sid[UNION_MAX_IDS];
    __shared__ int is_first[UNION_MAX_IDS];
    const int n = R * K, i = threadIdx.x;
    if (i < n) {
        sid[i] = ids[i];
        u_eid[i] = -1;
    }
    for (int j = i; j < n * R; j += blockDim.x) u_slot[j] = -1;
    __syncthreads();
    const int e = i < n ? sid[i] : 0;
    int first = i;
    for (int j = 0; j < i && i < n; ++j)
        if (sid[j] == e) { first = j; break; }
    if (i < n) is_first[i] = first == i;
    __syncthreads();
    if (i >= n) return;
    int u = 0;  // union index: distinct experts first seen before this one
    for (int j = 0; j < first; ++j) u += is_first[j];
    if (first == i) u_eid[u] = e;
    // a row naming the same expert twice keeps its later slot, as the NumPy twin does
    const int r = i / K;
    bool last = true;
    for (int j = i + 1; j < (r + 1) * K; ++j) last = last && sid[j] != e;
    if (last) u_slot[u * R + r] = i % K;
}

// One block; dynamic shared memory 4 * E bytes. Each thread owns experts tid, tid + blockDim, ...
// and scans the S = T*K flat ids twice (count, then place in flat order): stable by construction.
extern "C" __global__ void
moe_sort_by_expert(const int* __restrict__ ids, int S, int K, int E, int* __restrict__ sorted_token_ids,
                   int* __restrict__ sorted_expert_ids, int* __restrict__ expert_offsets,
                   int* __restrict__ token_to_perm) {
    int* pos = (int*)dyn_smem;
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        int c = 0;
        for (int i = 0; i < S; ++i) c += ids[i] == e;
        pos[e] = c;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int run = 0;
        for (int e = 0; e < E; ++e) {
            const int c = pos[e];
            expert_offsets[e] = run;
            pos[e] = run;
            run += c;
        }
        expert_offsets[E] = run;
    }
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        int p = pos[e];
        for (int i = 0; i < S; ++i) {
            if (ids[i] == e) {
                sorted_token_ids[p] = i / K;
                sorted_expert_ids[p] = e;
                token_to_perm[i] = p;
                ++p;
            }
        }
    }
}
