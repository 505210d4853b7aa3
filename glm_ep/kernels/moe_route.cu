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
    pdl_enter();
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

// A stable counting sort in ONE block of SORT_THREADS threads (W warps). Warp w owns the contiguous
// segment w of the S flat slots (whole 32-slot steps) and walks it twice in flat order. Dynamic shared
// memory: the E expert starts, then a [W][E] table. Pass 1 counts each expert in each segment (per step,
// the lowest lane of each group of equal ids, found by match_any, adds the group's size to its warp's
// row: no atomics, no other warp's row); one thread an expert turns its column into the exclusive prefix
// over the segments, and a block scan of the column totals gives the expert starts. Pass 2 places each
// slot at its expert's start + its segment's prefix + its rank among the equal ids of its step, the
// group's lowest lane moving the prefix on: flat order within a segment and across them, so the sort is
// stable. The expert ids of the sorted slots are then written range by range (coalesced; one SM's
// scattered stores are what the sort costs). Ids outside [0, E) are not placed (the router never
// writes one).
extern "C" __global__ void __launch_bounds__(SORT_THREADS, 1)
moe_sort_by_expert(const int* __restrict__ ids, int S, int K, int E, int* __restrict__ sorted_token_ids,
                   int* __restrict__ sorted_expert_ids, int* __restrict__ expert_offsets,
                   int* __restrict__ token_to_perm) {
    pdl_enter();
    constexpr int W = SORT_THREADS / 32;
    int* start = (int*)dyn_smem;  // [E]
    int* table = start + E;       // [W][E]
    __shared__ int warp_total[W];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const unsigned below = (1u << lane) - 1u;
    const int seg = (S + 32 * W - 1) / (32 * W) * 32, lo = warp * seg, hi = min(S, lo + seg);
    int* row = table + warp * E;
    auto id_at = [&](int i) {  // slot i's expert; -1 past the segment or outside [0, E)
        const int e = i < hi ? ids[i] : -1;
        return e < E ? e : -1;
    };
    for (int j = tid; j < W * E; j += SORT_THREADS) table[j] = 0;
    __syncthreads();
    for (int base = lo; base < hi; base += 32) {  // pass 1: the segment's counts
        const int e = id_at(base + lane);
        const unsigned peers = __match_any_sync(0xffffffffu, e);
        if (e >= 0 && lane == __ffs(peers) - 1) row[e] += __popc(peers);
        __syncwarp();
    }
    __syncthreads();
    for (int x = tid; x < E; x += SORT_THREADS) {  // table[w][x] <- x's slots in segments before w
        int acc = 0;
        for (int w = 0; w < W; ++w) {
            const int c = table[w * E + x];
            table[w * E + x] = acc;
            acc += c;
        }
        start[x] = acc;  // x's total, scanned below
    }
    __syncthreads();
    int carry = 0;  // the exclusive scan of the totals, SORT_THREADS experts at a time
    for (int x0 = 0; x0 < E; x0 += SORT_THREADS) {
        const int x = x0 + tid, v = x < E ? start[x] : 0, incl = warp_inclusive_sum(v);
        if (lane == 31) warp_total[warp] = incl;
        __syncthreads();
        int before = carry;
        for (int w = 0; w < warp; ++w) before += warp_total[w];
        if (x < E) {
            start[x] = before + incl - v;
            expert_offsets[x] = before + incl - v;
        }
        for (int w = 0; w < W; ++w) carry += warp_total[w];
        __syncthreads();
    }
    if (tid == 0) expert_offsets[E] = carry;
    for (int base = lo; base < hi; base += 32) {  // pass 2: place the segment's slots
        const int i = base + lane, e = id_at(i);
        const unsigned peers = __match_any_sync(0xffffffffu, e);
        const int before = e >= 0 ? row[e] : 0;
        __syncwarp();
        if (e >= 0) {
            const int p = start[e] + before + __popc(peers & below);
            sorted_token_ids[p] = i / K;
            token_to_perm[i] = p;
            if (lane == __ffs(peers) - 1) row[e] = before + __popc(peers);
        }
        __syncwarp();
    }
    for (int x = warp; x < E; x += W) {  // sorted_expert_ids: each expert's range, a warp's coalesced stores
        const int end = x + 1 < E ? start[x + 1] : carry;
        for (int p = start[x] + lane; p < end; p += 32) sorted_expert_ids[p] = x;
    }
}
