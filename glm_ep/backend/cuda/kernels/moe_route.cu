// On-device routing tables, mirroring glm_ep/mlp/routing.py exactly:
//   moe_union_table      the union of a row group's chosen experts in first-occurrence
//                        (row-major) order: u_eid [R*K] (-1 unused), u_slot [R*K, R] (-1: absent)
//   moe_sort_by_expert   a stable counting sort of the flat (row, slot) ids by expert, in one block
//   moe_sort_count       the same sort over several blocks: each block's per-expert counts of its chunk,
//   moe_sort_place       then each block places its chunk after the counts of the chunks before it
//
// NumPy twin: glm_ep/mlp/routing.py's union_table and sort_by_expert (NumpyBackend.union_table, sort_by_expert);
// held together by tests/cuda/test_cuda_union.py::test_union_table and
// tests/cuda/test_cuda_routed.py::test_sort_by_expert, exact.
#include "common.cuh"

#if !defined(UNION_MAX_IDS) || !defined(SORT_THREADS)
#error "UNION_MAX_IDS and SORT_THREADS are set by glm_ep/backend/cuda/kernel_loader.py"
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

// A stable counting sort of the S flat slots by expert, in blocks of SORT_THREADS threads (W warps). A block
// owns a contiguous chunk of the slots and warp w of it the contiguous segment w of the chunk (whole 32-slot
// steps), walked twice in flat order. Dynamic shared memory: the E expert starts, then a [W][E] table.
// Pass 1 (count_segment) counts each expert in each segment: per step, the lowest lane of each group of equal
// ids (match_any) adds the group's size to its warp's row; no atomics, no other warp's row. Pass 2
// (place_segment) puts each slot at start[e] + its warp's row[e] + its rank among the equal ids of its step,
// the group's lowest lane moving the row on: flat order within a segment, across segments and across blocks,
// so the sort is stable. Ids outside [0, E) are not placed (the router never writes one).
//   moe_sort_by_expert    ONE block over all S slots.
//   moe_sort_count        grid B, chunks of ceil(S / B): each block's per-expert counts to counts[B][E].
//   moe_sort_place        grid B, after it: each block counts its chunk again, adds the chunks before it
//                         (counts) and places its slots; block 0 writes expert_offsets.
// Both forms write each expert's sorted_expert_ids range with coalesced stores (one SM's scattered stores
// are what one block costs).
constexpr int SORT_W = SORT_THREADS / 32;

struct SortSegment {
    int lo, hi;  // this warp's flat slots
};

// Warp w's segment of the chunk [c0, c1).
__device__ __forceinline__ SortSegment sort_segment(int c0, int c1) {
    const int seg = (c1 - c0 + 32 * SORT_W - 1) / (32 * SORT_W) * 32, lo = c0 + (threadIdx.x >> 5) * seg;
    return {lo, min(c1, lo + seg)};
}

__device__ __forceinline__ int sort_id(const int* ids, int i, int hi, int E) {  // -1 past hi or outside [0, E)
    const int e = i < hi ? ids[i] : -1;
    return e < E ? e : -1;
}

// Pass 1: the segment's expert counts added to row[E].
__device__ __forceinline__ void count_segment(const int* ids, SortSegment g, int E, int* row) {
    const int lane = threadIdx.x & 31;
    for (int base = g.lo; base < g.hi; base += 32) {
        const int e = sort_id(ids, base + lane, g.hi, E);
        const unsigned peers = __match_any_sync(0xffffffffu, e);
        if (e >= 0 && lane == __ffs(peers) - 1) row[e] += __popc(peers);
        __syncwarp();
    }
}

// Pass 2: slot i of expert e goes to start[e] + row[e] + its rank in its step; row[e] moves on.
__device__ __forceinline__ void place_segment(const int* ids, SortSegment g, int K, int E, const int* start, int* row,
                                              int* sorted_token_ids, int* token_to_perm) {
    const int lane = threadIdx.x & 31;
    const unsigned below = (1u << lane) - 1u;
    for (int base = g.lo; base < g.hi; base += 32) {
        const int i = base + lane, e = sort_id(ids, i, g.hi, E);
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
}

// start[x] <- the exclusive scan of start[0..E) over x (SORT_THREADS experts at a time, the whole block);
// returns the sum (every thread).
__device__ __forceinline__ int scan_starts(int* start, int E) {
    __shared__ int warp_total[SORT_W];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    int carry = 0;
    for (int x0 = 0; x0 < E; x0 += SORT_THREADS) {
        const int x = x0 + tid, v = x < E ? start[x] : 0, incl = warp_inclusive_sum(v);
        if (lane == 31) warp_total[warp] = incl;
        __syncthreads();
        int before = carry;
        for (int w = 0; w < warp; ++w) before += warp_total[w];
        if (x < E) start[x] = before + incl - v;
        for (int w = 0; w < SORT_W; ++w) carry += warp_total[w];
        __syncthreads();
    }
    return carry;
}

// Every expert's sorted_expert_ids range [start[x], start[x + 1]) (end: total), experts first, first + step, ...
// one a warp.
__device__ __forceinline__ void write_expert_ranges(const int* start, int total, int E, int first, int step,
                                                    int* sorted_expert_ids) {
    const int lane = threadIdx.x & 31;
    for (int x = first; x < E; x += step) {
        const int end = x + 1 < E ? start[x + 1] : total;
        for (int p = start[x] + lane; p < end; p += 32) sorted_expert_ids[p] = x;
    }
}

// The block's segments counted into table[W][E] (zeroed here), then table[w][x] <- x's slots in the block's
// segments before w; returns with start[x] = x's slots in the whole chunk.
__device__ __forceinline__ void count_chunk(const int* ids, SortSegment g, int E, int* start, int* table) {
    const int tid = threadIdx.x;
    for (int j = tid; j < SORT_W * E; j += SORT_THREADS) table[j] = 0;
    __syncthreads();
    count_segment(ids, g, E, table + (tid >> 5) * E);
    __syncthreads();
    for (int x = tid; x < E; x += SORT_THREADS) {
        int acc = 0;
        for (int w = 0; w < SORT_W; ++w) {
            const int c = table[w * E + x];
            table[w * E + x] = acc;
            acc += c;
        }
        start[x] = acc;
    }
    __syncthreads();
}

extern "C" __global__ void __launch_bounds__(SORT_THREADS, 1)
moe_sort_by_expert(const int* __restrict__ ids, int S, int K, int E, int* __restrict__ sorted_token_ids,
                   int* __restrict__ sorted_expert_ids, int* __restrict__ expert_offsets,
                   int* __restrict__ token_to_perm) {
    pdl_enter();
    int* start = (int*)dyn_smem;  // [E]
    int* table = start + E;       // [W][E]
    const SortSegment g = sort_segment(0, S);
    count_chunk(ids, g, E, start, table);
    const int total = scan_starts(start, E);
    for (int x = threadIdx.x; x < E; x += SORT_THREADS) expert_offsets[x] = start[x];
    if (threadIdx.x == 0) expert_offsets[E] = total;
    place_segment(ids, g, K, E, start, table + (threadIdx.x >> 5) * E, sorted_token_ids, token_to_perm);
    write_expert_ranges(start, total, E, threadIdx.x >> 5, SORT_W, sorted_expert_ids);
}

__device__ __forceinline__ int sort_chunk(int S) { return (S + gridDim.x - 1) / gridDim.x; }

extern "C" __global__ void __launch_bounds__(SORT_THREADS, 1)
moe_sort_count(const int* __restrict__ ids, int S, int E, int* __restrict__ counts) {
    pdl_enter();
    int* start = (int*)dyn_smem;  // [E]
    int* table = start + E;       // [W][E]
    const int c = sort_chunk(S), c0 = min(S, blockIdx.x * c);
    count_chunk(ids, sort_segment(c0, min(S, c0 + c)), E, start, table);
    for (int x = threadIdx.x; x < E; x += SORT_THREADS) counts[(size_t)blockIdx.x * E + x] = start[x];
}

extern "C" __global__ void __launch_bounds__(SORT_THREADS, 1)
moe_sort_place(const int* __restrict__ ids, int S, int K, int E, const int* __restrict__ counts,
               int* __restrict__ sorted_token_ids, int* __restrict__ sorted_expert_ids,
               int* __restrict__ expert_offsets, int* __restrict__ token_to_perm) {
    pdl_enter();
    int* start = (int*)dyn_smem;  // [E]
    int* table = start + E;       // [W][E]
    const int c = sort_chunk(S), c0 = min(S, blockIdx.x * c), B = gridDim.x;
    const SortSegment g = sort_segment(c0, min(S, c0 + c));
    count_chunk(ids, g, E, start, table);
    for (int x = threadIdx.x; x < E; x += SORT_THREADS) {  // the chunks before this one, and x's total
        int before = 0, total = 0;
        for (int b = 0; b < B; ++b) {
            const int n = counts[(size_t)b * E + x];
            before += b < (int)blockIdx.x ? n : 0;
            total += n;
        }
        for (int w = 0; w < SORT_W; ++w) table[w * E + x] += before;
        start[x] = total;
    }
    __syncthreads();
    const int total = scan_starts(start, E);
    if (blockIdx.x == 0) {
        for (int x = threadIdx.x; x < E; x += SORT_THREADS) expert_offsets[x] = start[x];
        if (threadIdx.x == 0) expert_offsets[E] = total;
    }
    place_segment(ids, g, K, E, start, table + (threadIdx.x >> 5) * E, sorted_token_ids, token_to_perm);
    write_expert_ranges(start, total, E, blockIdx.x * SORT_W + (threadIdx.x >> 5), B * SORT_W, sorted_expert_ids);
}
