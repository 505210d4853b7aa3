// NVFP4 verify GEMV, 2..8 rows: each union expert swept ONCE for every row that chose it, on the
// decode ring's pipeline (nvfp4_ring.cuh) in the bf16 form, the rows being the mma's B columns.
// Numerics are the bf16 form's (consume_slab: the dequantized weight as bf16, one mma chain over K, as
// gemv_nvfp4.cu's block kernels); requirements and launch geometry are gemv_nvfp4_ring.cu's. A row's
// outputs are bit for bit the same whichever rows share the batch.
//
// NumPy twin: NumpyBackend.moe_gemv_union and moe_gate_up_act_union (glm_ep/backend/numpy_backend.py); held
// together by tests/cuda/test_cuda_union.py (every geometry and width; each row independent of the others).
#include "common.cuh"
#include "nvfp4_mma.cuh"
#include "async_copy.cuh"
#include "nvfp4_ring.cuh"

// ---- the union form (verify, R = 2..8 rows): one sweep of each union expert for all its rows ----
// Work item i: (local union entry i / groups, sixteen weight rows). x row r of an entry is the
// mma's B column r; absent rows are neither copied nor stored. The entry's row slots ride in one
// word (4 bits a row: top_k <= 16) with a presence mask, so the producer and the store need no
// table reads after the start.
static_assert(UNION_MAX_IDS <= 64, "a lane holds two compact union entries");
static_assert(ROUTER_MAX_TOP_K <= 16, "a row's slot is 4 bits of UnionEntry::slots");

struct UnionEntry {
    unsigned slots;  // row r's slot in bits 4 r .. 4 r + 3
    unsigned present;  // bit r: row r chose this expert
};

// Lane j: compact local entries j and j + 32 of the U union entries (their pointers, scale_2 x 128
// and rows; u_slot is [U, rows], rows <= R); returns the count.
template <int P, int R>
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
        for (int r = 0; r < R; ++r) {
            const int slot = ok && r < rows ? u_slot[u * rows + r] : -1;
            if (slot >= 0) {
                ent[h].slots |= (unsigned)slot << (4 * r);
                ent[h].present |= 1u << r;
            }
        }
    }
    return n;
}

// Union item sources: the weights as ItemSrc, x through the entry's rows.
template <int P>
struct UnionSrc {
    ItemSrc<P> wsrc;
    UnionEntry ent;
    const bf16_t* x;
    long long x_row_stride, x_slot_stride;  // x row r, slot s at x + r x_row_stride + s x_slot_stride
};

template <int P, int R>
__device__ __forceinline__ void union_src(int j, int n0, const u64_t (&wb)[2][P], const u64_t (&sb)[2][P],
                                          const UnionEntry (&ent)[2], int K, UnionSrc<P>& src) {
    const int lane_of = j & 31, h = j >> 5;  // warp-uniform
    src.wsrc.row_bytes = K >> 1;
    src.wsrc.scale_row_bytes = K >> 4;
#pragma unroll
    for (int p = 0; p < P; ++p) {
        const u64_t w = h ? wb[1][p] : wb[0][p], s = h ? sb[1][p] : sb[0][p];
        src.wsrc.w[p] = (const unsigned char*)__shfl_sync(0xffffffffu, w, lane_of) + (size_t)n0 * src.wsrc.row_bytes;
        src.wsrc.s[p] = (const unsigned char*)__shfl_sync(0xffffffffu, s, lane_of) + (size_t)n0 * src.wsrc.scale_row_bytes;
    }
    const UnionEntry e = h ? ent[1] : ent[0];
    src.ent = UnionEntry{__shfl_sync(0xffffffffu, e.slots, lane_of), __shfl_sync(0xffffffffu, e.present, lane_of)};
}

// Copy slab b of a union item: the weights, then each present x row's 256 T bytes (16 T pieces; one row per
// copy instruction, so its pointer is warp-uniform). An absent row is not copied: its mma column reads what an
// earlier item left (NaN possibly), and since a column of the mma's output depends on its own B column alone,
// what it computes stays in that column, which is never stored.
template <int P, int T, int R>
__device__ __forceinline__ void issue_union_slab(RingStage<P, T, R>& st, const UnionSrc<P>& src, int b) {
    static_assert(16 * T % 32 == 0, "a copy instruction covers 32 pieces of one x row");
    const int lane = threadIdx.x & 31;
    issue_weights<P, T, R>(st, src.wsrc, b);
#pragma unroll
    for (int q = 0; q < R * 16 * T / 32; ++q) {
        const int i = 32 * q + lane, r = i / (16 * T), j = i % (16 * T);
        if (!((src.ent.present >> r) & 1u)) continue;  // warp-uniform; an absent row's columns are never stored
        const bf16_t* row = src.x + r * src.x_row_stride + (long long)((src.ent.slots >> (4 * r)) & 15u) * src.x_slot_stride;
        cp_async16(smem_u32(&st.x[r][xswz<R>(r, j)]), row + 128 * T * (size_t)b + 8 * j);
    }
}

// Outputs of one union item: lane (g, t) holds weight rows n0 + g (acc[p][c]) and n0 + g + 8
// (acc[p][2 + c]) of x rows 2 t + c.
template <int P, int R>
__device__ __forceinline__ void store_union_item(const RingOut& o, long long out_row_stride, const UnionEntry& ent,
                                                 int n0, int N, const float (&f)[P], const float (&acc)[P][4]) {
    const int lane = threadIdx.x & 31, n = n0 + (lane >> 2), t = lane & 3;
#pragma unroll
    for (int c = 0; c < 2; ++c) {
        const int r = 2 * t + c;
        if (r >= R || !((ent.present >> r) & 1u)) continue;
        const long long off = r * out_row_stride + (long long)((ent.slots >> (4 * r)) & 15u) * N;
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

template <int P, int T, int D, int R>
__device__ __forceinline__ void ring_union(const bf16_t* x, long long x_row_stride, long long x_slot_stride,
                                           const u64_t* const (&wp)[P], const u64_t* const (&sp)[P],
                                           const float* const (&s2)[P], const int* u_eid, const int* u_slot, int U,
                                           int rows, int start, int count, const RingOut& o, long long out_row_stride,
                                           int N, int K, unsigned* claims) {
    u64_t wb[2][P], sb[2][P];
    float fb[2][P];
    UnionEntry ents[2];
    const int nlocal = local_entries<P, R>(u_eid, u_slot, U, rows, start, count, wp, sp, s2, wb, sb, fb, ents);
    const int groups = N >> 4;
    const int W = gridDim.x * RING_WARPS, w0 = blockIdx.x * RING_WARPS + (threadIdx.x >> 5);
    RingStage<P, T, R>* ring = reinterpret_cast<RingStage<P, T, R>*>(dyn_smem) + (threadIdx.x >> 5) * D;
    UnionSrc<P> src;
    src.x = x;
    src.x_row_stride = x_row_stride;
    src.x_slot_stride = x_slot_stride;
    float acc[P][4];
    zero_acc<P>(acc);
    ring_pipeline<D>(
        ring, w0, W, nlocal * groups, K / (128 * T), claims,
        [&](int item) { union_src<P, R>(item / groups, (item % groups) * 16, wb, sb, ents, K, src); },
        [&](RingStage<P, T, R>& st, int b) { issue_union_slab<P, T, R>(st, src, b); },
        [&](const RingStage<P, T, R>& st, int, int) { consume_slab<P, T, R>(st, acc); },
        [&](int item) {
            const int j = item / groups, lane_of = j & 31, h = j >> 5;
            float f2[P];
#pragma unroll
            for (int p = 0; p < P; ++p) f2[p] = __shfl_sync(0xffffffffu, h ? fb[1][p] : fb[0][p], lane_of);
            const UnionEntry e = h ? ents[1] : ents[0];
            const UnionEntry ent{__shfl_sync(0xffffffffu, e.slots, lane_of), __shfl_sync(0xffffffffu, e.present, lane_of)};
            store_union_item<P, R>(o, out_row_stride, ent, (item % groups) * 16, N, f2, acc);
            zero_acc<P>(acc);
        });
}

// Union entry points, R x rows staged (the wrapper rounds the group's `rows` up to 2, 4, 6 or 8; rows
// past it are absent from every entry):
//   nvfp4_ring_union_gemv_r{R}_t{T}_d{D}   one projection; x [R, Kin] or per slot [R, top_k, Kin]
//   nvfp4_ring_union_glu_r{R}_t{T}_d{D}    gate + up + clamped SwiGLU fused
#define RING_UNION_ENTRIES(R, T, D)                                                                                 \
    static_assert(sizeof(RingStage<1, T, R>) == RING_STAGE_BYTES_P1_T##T##_R##R &&                                   \
                      sizeof(RingStage<2, T, R>) == RING_STAGE_BYTES_P2_T##T##_R##R,                                 \
                  "a union ring stage differs from ring_stage_bytes in glm_ep/backend/cuda/kernel_loader.py");            \
    extern "C" __global__ void __launch_bounds__(RING_THREADS) nvfp4_ring_union_gemv_r##R##_t##T##_d##D(             \
        const bf16_t* __restrict__ x, long long x_row_stride, long long x_slot_stride,                               \
        const u64_t* __restrict__ packed_ptrs, const u64_t* __restrict__ scale_ptrs, const float* __restrict__ scale2, \
        const int* __restrict__ u_eid, const int* __restrict__ u_slot, int U, int rows, int start, int count,       \
        bf16_t* __restrict__ out, long long out_row_stride, int N, int K, unsigned* claims) {                        \
        pdl_enter();                                                                                                 \
        const u64_t* const wp[1] = {packed_ptrs};                                                                   \
        const u64_t* const sp[1] = {scale_ptrs};                                                                    \
        const float* const s2[1] = {scale2};                                                                        \
        const RingOut o = {out, nullptr, nullptr, nullptr, 0.0f};                                                   \
        ring_union<1, T, D, R>(x, x_row_stride, x_slot_stride, wp, sp, s2, u_eid, u_slot, U, rows, start, count, o,  \
                               out_row_stride, N, K, claims);                                                       \
    }                                                                                                               \
    extern "C" __global__ void __launch_bounds__(RING_THREADS) nvfp4_ring_union_glu_r##R##_t##T##_d##D(              \
        const bf16_t* __restrict__ x, long long x_row_stride, const u64_t* __restrict__ gate_packed,                 \
        const u64_t* __restrict__ gate_scale, const float* __restrict__ gate_scale2,                                \
        const u64_t* __restrict__ up_packed, const u64_t* __restrict__ up_scale, const float* __restrict__ up_scale2, \
        const int* __restrict__ u_eid, const int* __restrict__ u_slot, int U, int rows, int start, int count,       \
        bf16_t* __restrict__ gate, bf16_t* __restrict__ up, bf16_t* __restrict__ act, long long out_row_stride,      \
        int N, int K, float limit, unsigned* claims) {                                                              \
        pdl_enter();                                                                                                \
        const u64_t* const wp[2] = {gate_packed, up_packed};                                                        \
        const u64_t* const sp[2] = {gate_scale, up_scale};                                                          \
        const float* const s2[2] = {gate_scale2, up_scale2};                                                        \
        const RingOut o = {nullptr, gate, up, act, limit};                                                          \
        ring_union<2, T, D, R>(x, x_row_stride, 0, wp, sp, s2, u_eid, u_slot, U, rows, start, count, o,             \
                               out_row_stride, N, K, claims);                                                       \
    }

RING_UNION_ENTRIES(2, 2, 3)
RING_UNION_ENTRIES(4, 2, 3)
RING_UNION_ENTRIES(6, 2, 3)
RING_UNION_ENTRIES(8, 2, 3)
RING_UNION_ENTRIES(2, 4, 2)
RING_UNION_ENTRIES(4, 4, 2)
RING_UNION_ENTRIES(6, 4, 2)
RING_UNION_ENTRIES(8, 4, 2)
RING_UNION_ENTRIES(2, 2, 2)
RING_UNION_ENTRIES(4, 2, 2)
RING_UNION_ENTRIES(6, 2, 2)
RING_UNION_ENTRIES(8, 2, 2)
