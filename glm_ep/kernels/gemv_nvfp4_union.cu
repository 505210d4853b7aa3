// NVFP4 verify GEMV, 2..8 rows: each union expert's weights swept for every row that chose it at once
// (or once per S of them: the stage's x columns), on the decode ring's pipeline (nvfp4_ring.cuh) in
// the bf16 form, the rows being the mma's B columns. Numerics, requirements and launch geometry are
// gemv_nvfp4_ring.cu's; a row's outputs equal its one-row decode bit for bit, whichever rows share the
// batch and whichever column it takes.
#include "common.cuh"
#include "nvfp4_mma.cuh"
#include "async_copy.cuh"
#include "nvfp4_ring.cuh"

// ---- the union form (verify, 2..8 rows): one sweep of each union expert for all its rows ----
// A union entry's rows are the mma's B columns: the stage holds S x columns (S = 2, 4 or 8), and an
// entry chosen by more than S rows is swept once per S of them (its sub-entries, adjacent in item
// order, so the second sweep mostly finds the weights in L2). Work item i: (sub-entry i / groups,
// sixteen weight rows). A sub-entry's present rows take columns 0, 1, ... in row order; the other
// columns are zero-filled and not stored (a column's results depend on that column alone). The
// entry's row slots ride in one word (4 bits a row: top_k <= 16) with a presence mask, so the
// producer and the store need no table reads after the start.
static_assert(UNION_MAX_IDS <= 64, "a lane holds two compact union entries");
static_assert(ROUTER_MAX_TOP_K <= 16, "a row's slot is 4 bits of UnionEntry::slots");
static_assert(UNION_MAX_ROWS <= 8, "a row is 4 bits of UnionCols::cols, and UnionEntry::slots holds 8 rows");

struct UnionEntry {
    unsigned slots;  // row r's slot in bits 4 r .. 4 r + 3
    unsigned present;  // bit r: row r chose this expert
};

// The x columns of one sub-entry: column c's row in bits 8 c .. 8 c + 3, its slot in bits 8 c + 4 .. 8 c + 7.
struct UnionCols {
    unsigned long long cols;
    int n;  // columns in use
    __device__ __forceinline__ int row(int c) const { return (int)((cols >> (8 * c)) & 15u); }
    __device__ __forceinline__ int slot(int c) const { return (int)((cols >> (8 * c + 4)) & 15u); }
};

// Lane j: compact local entries j and j + 32 of the U union entries (their pointers, scale_2 x 128
// and rows; u_slot is [U, rows], rows <= UNION_MAX_ROWS); returns the count.
template <int P>
__device__ __forceinline__ int local_entries(const int* u_eid, const int* u_slot, int U, int rows, int start, int count,
                                             const u64_t* const (&wp)[P], const u64_t* const (&sp)[P],
                                             const float* const (&s2)[P], u64_t (&w)[2][P], u64_t (&s)[2][P],
                                             float (&f)[2][P], UnionEntry (&ent)[2]) {
    const int lane = threadIdx.x & 31;
    unsigned mask[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int u = lane + 32 * h;
        const int id = u < U ? u_eid[u] : -1, e = id - start;
        mask[h] = __ballot_sync(0xffffffffu, id >= 0 && e >= 0 && e < count);
    }
    const int n0 = __popc(mask[0]), n = n0 + __popc(mask[1]);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int c = lane + 32 * h;  // compact index -> union entry: the c-th set bit of the masks
        const int hh = c < n0 ? 0 : 1;
        unsigned m = hh ? mask[1] : mask[0];
        for (int q = 0, k = hh ? c - n0 : c; q < k && m; ++q) m &= m - 1;
        const bool ok = c < n && m;
        const int u = ok ? 32 * hh + __ffs(m) - 1 : 0, le = ok ? u_eid[u] - start : 0;
        ent[h] = UnionEntry{0u, 0u};
#pragma unroll
        for (int p = 0; p < P; ++p) {
            w[h][p] = ok ? wp[p][le] : 0ull;
            s[h][p] = ok ? sp[p][le] : 0ull;
            f[h][p] = ok ? s2[p][le] * 128.0f : 0.0f;
        }
#pragma unroll
        for (int r = 0; r < UNION_MAX_ROWS; ++r) {
            const int slot = ok && r < rows ? u_slot[u * rows + r] : -1;
            if (slot >= 0) {
                ent[h].slots |= (unsigned)slot << (4 * r);
                ent[h].present |= 1u << r;
            }
        }
    }
    return n;
}

// The sub-entries of the lane's two entries: first[h] is the index of entry lane + 32 h's first (INT_MAX
// past the local entries); returns how many there are in all.
template <int S>
__device__ __forceinline__ int sub_entries(const UnionEntry (&ent)[2], int nlocal, int (&first)[2]) {
    const int lane = threadIdx.x & 31;
    int total = 0;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const bool ok = lane + 32 * h < nlocal;
        const int cnt = ok ? (__popc(ent[h].present) + S - 1) / S : 0;
        const int inc = warp_inclusive_sum(cnt) + total;
        first[h] = ok ? inc - cnt : 0x7fffffff;
        total = __shfl_sync(0xffffffffu, inc, 31);
    }
    return total;
}

// Sub-entry `sub` (warp-uniform): its compact entry j, and the columns of its rows (the entry's present
// rows past the first q S, at most S of them).
template <int S>
__device__ __forceinline__ int sub_entry(int sub, const int (&first)[2], const UnionEntry (&ents)[2], UnionCols& uc) {
    // the firsts are nondecreasing in the compact index: the sub-entry is the last entry's starting at or before it
    const int j = __popc(__ballot_sync(0xffffffffu, first[0] <= sub)) +
                  __popc(__ballot_sync(0xffffffffu, first[1] <= sub)) - 1;
    const int lane_of = j & 31, h = j >> 5;
    const int q = sub - __shfl_sync(0xffffffffu, h ? first[1] : first[0], lane_of);
    const UnionEntry e = h ? ents[1] : ents[0];
    const unsigned slots = __shfl_sync(0xffffffffu, e.slots, lane_of);
    unsigned m = __shfl_sync(0xffffffffu, e.present, lane_of);
    for (int i = 0; i < q * S && m; ++i) m &= m - 1;
    uc.cols = 0ull;
    uc.n = 0;
#pragma unroll
    for (int c = 0; c < S; ++c) {
        if (m) {
            const unsigned r = (unsigned)__ffs(m) - 1u;
            m &= m - 1;
            uc.cols |= (unsigned long long)(r | (((slots >> (4 * r)) & 15u) << 4)) << (8 * c);
            uc.n = c + 1;
        }
    }
    return j;
}

// Union item sources: the weights as ItemSrc, x through the sub-entry's columns.
template <int P>
struct UnionSrc {
    ItemSrc<P> wsrc;
    UnionCols uc;
    const bf16_t* x;
    long long x_row_stride, x_slot_stride;  // x row r, slot s at x + r x_row_stride + s x_slot_stride
};

template <int P, int S>
__device__ __forceinline__ void union_src(int sub, int n0, const int (&first)[2], const u64_t (&wb)[2][P],
                                          const u64_t (&sb)[2][P], const UnionEntry (&ent)[2], int K,
                                          UnionSrc<P>& src) {
    const int j = sub_entry<S>(sub, first, ent, src.uc);
    const int lane_of = j & 31, h = j >> 5;  // warp-uniform
    src.wsrc.row_bytes = K >> 1;
    src.wsrc.scale_row_bytes = K >> 4;
#pragma unroll
    for (int p = 0; p < P; ++p) {
        const u64_t w = h ? wb[1][p] : wb[0][p], s = h ? sb[1][p] : sb[0][p];
        src.wsrc.w[p] = (const unsigned char*)__shfl_sync(0xffffffffu, w, lane_of) + (size_t)n0 * src.wsrc.row_bytes;
        src.wsrc.s[p] =
            (const unsigned char*)__shfl_sync(0xffffffffu, s, lane_of) + (size_t)n0 * src.wsrc.scale_row_bytes;
    }
}

// Copy slab b of a union item: the weights, then each x column's 256 T bytes (16 T pieces; one column per
// copy instruction, so its pointer is warp-uniform), zero-filled for a column past the sub-entry's rows.
template <int P, int T, int S>
__device__ __forceinline__ void issue_union_slab(RingStage<P, T, S>& st, const UnionSrc<P>& src, int b) {
    static_assert(16 * T % 32 == 0, "a copy instruction covers 32 pieces of one x column");
    const int lane = threadIdx.x & 31;
    issue_weights<P, T, S>(st, src.wsrc, b);
#pragma unroll
    for (int q = 0; q < S * 16 * T / 32; ++q) {
        const int i = 32 * q + lane, c = i / (16 * T), j = i % (16 * T);
        const bool here = c < src.uc.n;
        const bf16_t* row = src.x + src.uc.row(c) * src.x_row_stride + (long long)src.uc.slot(c) * src.x_slot_stride;
        cp_async16_zfill(smem_u32(&st.x[c][xswz<S>(c, j)]), here ? (const void*)(row + 128 * T * (size_t)b + 8 * j)
                                                                  : (const void*)src.x, here);
    }
}

// Outputs of one union item: lane (g, t) holds weight rows n0 + g (acc[p][c]) and n0 + g + 8
// (acc[p][2 + c]) of x columns 2 t + c.
template <int P, int S>
__device__ __forceinline__ void store_union_item(const RingOut& o, long long out_row_stride, const UnionCols& uc,
                                                 int n0, int N, const float (&f)[P], const float (&acc)[P][4]) {
    const int lane = threadIdx.x & 31, n = n0 + (lane >> 2), t = lane & 3;
#pragma unroll
    for (int c = 0; c < 2; ++c) {
        const int col = 2 * t + c;
        if (col >= S || col >= uc.n) continue;
        const long long off = uc.row(col) * out_row_stride + (long long)uc.slot(col) * N;
        if (P == 1) {
            o.out[off + n] = f32_to_bf16(acc[0][c] * f[0]);
            o.out[off + n + 8] = f32_to_bf16(acc[0][2 + c] * f[0]);
        } else {
            glu_store(o.gate + off, o.up + off, o.act + off, n, acc[0][c] * f[0], acc[P - 1][c] * f[P - 1], o.limit);
            glu_store(o.gate + off, o.up + off, o.act + off, n + 8, acc[0][2 + c] * f[0], acc[P - 1][2 + c] * f[P - 1],
                      o.limit);
        }
    }
}

template <int P, int T, int D, int S>
__device__ __forceinline__ void ring_union(const bf16_t* x, long long x_row_stride, long long x_slot_stride,
                                           const u64_t* const (&wp)[P], const u64_t* const (&sp)[P],
                                           const float* const (&s2)[P], const int* u_eid, const int* u_slot, int U,
                                           int rows, int start, int count, const RingOut& o, long long out_row_stride,
                                           int N, int K) {
    u64_t wb[2][P], sb[2][P];
    float fb[2][P];
    UnionEntry ents[2];
    int first[2];
    const int nlocal = local_entries<P>(u_eid, u_slot, U, rows, start, count, wp, sp, s2, wb, sb, fb, ents);
    const int nsub = sub_entries<S>(ents, nlocal, first);
    const int groups = N >> 4;
    const int W = gridDim.x * RING_WARPS, w0 = blockIdx.x * RING_WARPS + (threadIdx.x >> 5);
    RingStage<P, T, S>* ring = reinterpret_cast<RingStage<P, T, S>*>(dyn_smem) + (threadIdx.x >> 5) * D;
    UnionSrc<P> src;
    src.x = x;
    src.x_row_stride = x_row_stride;
    src.x_slot_stride = x_slot_stride;
    float acc[P][4];
    zero_acc<P>(acc);
    ring_pipeline<D>(
        ring, w0, W, nsub * groups, K / (128 * T),
        [&](int item) { union_src<P, S>(item / groups, (item % groups) * 16, first, wb, sb, ents, K, src); },
        [&](RingStage<P, T, S>& st, int b) { issue_union_slab<P, T, S>(st, src, b); },
        [&](const RingStage<P, T, S>& st, int, int) { consume_slab<P, T, S>(st, acc); },
        [&](int item) {
            UnionCols uc;
            const int j = sub_entry<S>(item / groups, first, ents, uc), lane_of = j & 31, h = j >> 5;
            float f2[P];
#pragma unroll
            for (int p = 0; p < P; ++p) f2[p] = __shfl_sync(0xffffffffu, h ? fb[1][p] : fb[0][p], lane_of);
            store_union_item<P, S>(o, out_row_stride, uc, (item % groups) * 16, N, f2, acc);
            zero_acc<P>(acc);
        });
}

// Union entry points, S x columns staged (cuda/ring.py: the group's rows rounded up to 2, 4 or 8, or fewer
// where levers.ring_union_columns says so), any rows <= UNION_MAX_ROWS:
//   nvfp4_ring_union_gemv_c{S}_t{T}_d{D}   one projection; x [rows, Kin] or per slot [rows, top_k, Kin]
//   nvfp4_ring_union_glu_c{S}_t{T}_d{D}    gate + up + clamped SwiGLU fused
#define RING_UNION_ENTRIES(S, T, D)                                                                                 \
    static_assert(sizeof(RingStage<1, T, S>) == RING_STAGE_BYTES_P1_T##T##_R##S &&                                   \
                      sizeof(RingStage<2, T, S>) == RING_STAGE_BYTES_P2_T##T##_R##S,                                 \
                  "a union ring stage differs from ring_stage_bytes in glm_ep/backend/cuda/loader.py");            \
    extern "C" __global__ void __launch_bounds__(RING_THREADS) nvfp4_ring_union_gemv_c##S##_t##T##_d##D(             \
        const bf16_t* __restrict__ x, long long x_row_stride, long long x_slot_stride,                               \
        const u64_t* __restrict__ packed_ptrs, const u64_t* __restrict__ scale_ptrs, const float* __restrict__ scale2, \
        const int* __restrict__ u_eid, const int* __restrict__ u_slot, int U, int rows, int start, int count,       \
        bf16_t* __restrict__ out, long long out_row_stride, int N, int K) {                                          \
        pdl_enter();                                                                                                 \
        const u64_t* const wp[1] = {packed_ptrs};                                                                   \
        const u64_t* const sp[1] = {scale_ptrs};                                                                    \
        const float* const s2[1] = {scale2};                                                                        \
        const RingOut o = {out, nullptr, nullptr, nullptr, 0.0f};                                                   \
        ring_union<1, T, D, S>(x, x_row_stride, x_slot_stride, wp, sp, s2, u_eid, u_slot, U, rows, start, count, o,  \
                               out_row_stride, N, K);                                                               \
    }                                                                                                               \
    extern "C" __global__ void __launch_bounds__(RING_THREADS) nvfp4_ring_union_glu_c##S##_t##T##_d##D(              \
        const bf16_t* __restrict__ x, long long x_row_stride, const u64_t* __restrict__ gate_packed,                 \
        const u64_t* __restrict__ gate_scale, const float* __restrict__ gate_scale2,                                \
        const u64_t* __restrict__ up_packed, const u64_t* __restrict__ up_scale, const float* __restrict__ up_scale2, \
        const int* __restrict__ u_eid, const int* __restrict__ u_slot, int U, int rows, int start, int count,       \
        bf16_t* __restrict__ gate, bf16_t* __restrict__ up, bf16_t* __restrict__ act, long long out_row_stride,      \
        int N, int K, float limit) {                                                                                \
        pdl_enter();                                                                                                \
        const u64_t* const wp[2] = {gate_packed, up_packed};                                                        \
        const u64_t* const sp[2] = {gate_scale, up_scale};                                                          \
        const float* const s2[2] = {gate_scale2, up_scale2};                                                        \
        const RingOut o = {nullptr, gate, up, act, limit};                                                          \
        ring_union<2, T, D, S>(x, x_row_stride, 0, wp, sp, s2, u_eid, u_slot, U, rows, start, count, o,             \
                               out_row_stride, N, K);                                                               \
    }

RING_UNION_ENTRIES(2, 2, 3)
RING_UNION_ENTRIES(4, 2, 3)
RING_UNION_ENTRIES(8, 2, 3)
RING_UNION_ENTRIES(2, 4, 2)
RING_UNION_ENTRIES(4, 4, 2)
RING_UNION_ENTRIES(8, 4, 2)
