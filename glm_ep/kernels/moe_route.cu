// On-device routing tables, mirroring glm_ep/routing.py exactly:
//   moe_union_table      the union of a row group's chosen experts in first-occurrence
//                        (row-major) order: u_eid [R*K] (-1 unused), u_slot [R*K, R] (-1: absent)
//   moe_sort_by_expert   a stable counting sort of the flat (row, slot) ids by expert
#include "common.cuh"

#if !defined(UNION_MAX_IDS) || !defined(SORT_THREADS)
#error "UNION_MAX_IDS and SORT_THREADS are set by glm_ep/backend/cuda/loader.py"
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

// A stable counting sort in ONE block of SORT_THREADS threads. Dynamic shared memory: the E running
// positions, then a [warps][E] table. Histogram (shared atomics), exclusive scan, then the S flat
// slots placed SORT_THREADS at a time: a slot's position is its expert's running position, plus the
// counts of that expert in the chunk's earlier warps (a prefix over the table), plus its rank among
// the equal ids of its own warp (match_any), which is flat order, so the sort is stable. Ids outside
// [0, E) are not placed (the router never writes one).
extern "C" __global__ void __launch_bounds__(SORT_THREADS)
moe_sort_by_expert(const int* __restrict__ ids, int S, int K, int E, int* __restrict__ sorted_token_ids,
                   int* __restrict__ sorted_expert_ids, int* __restrict__ expert_offsets,
                   int* __restrict__ token_to_perm) {
    constexpr int W = SORT_THREADS / 32;
    int* run = (int*)dyn_smem;  // [E]
    int* table = run + E;       // [W][E]
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    for (int j = tid; j < E; j += SORT_THREADS) run[j] = 0;
    for (int j = tid; j < W * E; j += SORT_THREADS) table[j] = 0;
    __syncthreads();
    for (int i = tid; i < S; i += SORT_THREADS) {
        const int e = ids[i];
        if (e >= 0 && e < E) atomicAdd(&run[e], 1);
    }
    __syncthreads();
    if (tid == 0) {
        int acc = 0;
        for (int e = 0; e < E; ++e) {
            const int c = run[e];
            expert_offsets[e] = acc;
            run[e] = acc;
            acc += c;
        }
        expert_offsets[E] = acc;
    }
    __syncthreads();
    const unsigned below = (1u << lane) - 1u;
    for (int base = 0; base < S; base += SORT_THREADS) {
        const int i = base + tid;
        int e = i < S ? ids[i] : -1;
        if (e >= E) e = -1;
        const unsigned peers = __match_any_sync(0xffffffffu, e);
        if (e >= 0 && lane == __ffs(peers) - 1) table[warp * E + e] = __popc(peers);
        __syncthreads();
        for (int x = tid; x < E; x += SORT_THREADS) {  // table[w][x] <- position of warp w's first x
            int acc = run[x];
            for (int w = 0; w < W; ++w) {
                const int c = table[w * E + x];
                table[w * E + x] = acc;
                acc += c;
            }
            run[x] = acc;
        }
        __syncthreads();
        if (e >= 0) {
            const int p = table[warp * E + e] + __popc(peers & below);
            sorted_token_ids[p] = i / K;
            sorted_expert_ids[p] = e;
            token_to_perm[i] = p;
        }
        __syncthreads();
        for (int j = tid; j < W * E; j += SORT_THREADS) table[j] = 0;
        __syncthreads();
    }
}
