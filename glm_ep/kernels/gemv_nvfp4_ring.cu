// NVFP4 decode GEMV of ONE row for every top-k slot, as a persistent stream: a grid of a few warps
// per SM (cuda/ring.py) whose warps each own whole work items (local slot, sixteen weight rows) and
// sweep their FULL K: no K split, no block reduction, no barrier. A warp streams its items through a
// private ring of D shared-memory stages filled by cp.async, one stage per slab of T 128-k steps:
// per matrix the 16 rows' 64 T weight bytes (a copy instruction takes 32 consecutive 16-byte pieces:
// whole 128-byte lines of 32 / (4 T) rows), their 8 T scale bytes, and 256 T bytes of x. The lanes
// then read their mma fragments from shared memory. D - 1 slabs are in flight ACROSS item
// boundaries: the next item's loads are issued while the current one is still being multiplied.
// The ids and the pointer tables are read once per warp, up front: lane j holds local slot j's.
//
// Numerics of the bf16 form are gemv_nvfp4.cu's (the fp16 form's: see consume_slab_f16): within a
// slab the lanes take the same chunks (lane (g, t): chunk 4 s + t of rows n0 + g and n0 + g + 8 at
// step s), so every output sees the same mma chain over K in the same order and the same final
// roundings. Requires K % (128 T) == 0 and N % 16 == 0 (cuda/ring.py sends other shapes to
// gemv_nvfp4.cu). Work item i of warp w: i = w, w + W, w + 2W, ... (W warps in the grid), local
// slot i / groups, rows 16 (i % groups) ..; a slot whose expert id is outside [start, start + count)
// is not an item and its output is left untouched.
//
// Entry points, T = steps per slab, D = ring depth (grid (blocks), RING_WARPS warps per block, D
// stages of ring_stage_bytes(P, T) per warp of dynamic shared memory; computed in cuda/ring.py):
//   nvfp4_ring_moe_gemv_t{T}_d{D}   one projection, x[0] or x[slot]            P = 1
//   nvfp4_ring_moe_glu_t{T}_d{D}    gate + up + clamped SwiGLU fused            P = 2
//   nvfp4_ring_moe_{gemv,glu}_f16_t{T}_d{D}   the same in the fp16 form (consume_slab_f16: fp16
//       operands, x rounded to fp16, the block scale applied to each 16-k group's fp32 partial)
//   nvfp4_ring_union_{gemv,glu}_r{R}_t{T}_d{D}  verify, 2..8 rows: items are (union expert, sixteen
//       weight rows), each swept ONCE for every row that chose the expert (the rows are the mma's B
//       columns), in the bf16 form; stages of ring_stage_bytes(P, T, R)
#include "common.cuh"
#include "nvfp4_mma.cuh"
#include "async_copy.cuh"

#ifndef RING_WARPS
#error "RING_WARPS is set by glm_ep/backend/cuda/loader.py"
#endif
#define RING_THREADS (RING_WARPS * 32)

// One slab (T steps of 128 k) of one warp's item. Weight piece j (16 bytes, chunk j of the slab) of
// row r is stored at piece j ^ 4 (r & 1), so the quads of rows g and g + 1 read disjoint banks. R x
// rows: 1 for decode, up to 8 for a union item (piece j of x row r at xswz<R>(r, j)).
template <int P, int T, int R = 1>
struct RingStage {
    uint4 w[P][16][4 * T];  // [matrix][row - n0][piece]: the slab's 64 T bytes of the row
    uint4 s[P][16][T / 2];  // [matrix][row - n0]: the slab's 8 T scale bytes
    uint4 x[R][16 * T];     // the slab's 128 T k of each x row
};

__device__ __forceinline__ int swz(int row, int piece) { return piece ^ ((row & 1) << 2); }

// A union step reads, per phase of 8 lanes, pieces 16 s + 4 t + q (t = 0..3) of two x rows: XOR bit 1
// with bit 3 and bit 0 with the row's parity so the 8 pieces fall in 8 distinct bank groups.
template <int R>
__device__ __forceinline__ int xswz(int row, int piece) {
    return R == 1 ? piece : piece ^ (((piece >> 3) & 1) << 1) ^ (row & 1);
}

// Lane j: the j-th local slot (slot index, matrix base pointers, scale_2); returns the count.
template <int P>
__device__ __forceinline__ int local_slots(const int* ids, int S, int start, int count, const u64_t* const (&wp)[P],
                                           const u64_t* const (&sp)[P], const float* const (&s2)[P], int& slot,
                                           u64_t (&w)[P], u64_t (&s)[P], float (&f)[P]) {
    const int lane = threadIdx.x & 31;
    int e = -1;
    if (lane < S) {
        const int id = ids[lane];
        e = id - start;
        if (id < 0 || e < 0 || e >= count) e = -1;
    }
    const unsigned mask = __ballot_sync(0xffffffffu, e >= 0);
    unsigned m = mask;  // the lane-th set bit of mask
    for (int q = 0; q < lane && m; ++q) m &= m - 1;
    slot = m ? __ffs(m) - 1 : 0;
    const int le = __shfl_sync(0xffffffffu, e, slot);
#pragma unroll
    for (int p = 0; p < P; ++p) {
        w[p] = m ? wp[p][le] : 0ull;
        s[p] = m ? sp[p][le] : 0ull;
        f[p] = m ? s2[p][le] * 128.0f : 0.0f;
    }
    return __popc(mask);
}

// Where the producer reads an item: row n0 of each matrix's weights and scales, and x.
template <int P>
struct ItemSrc {
    const unsigned char* w[P];
    const unsigned char* s[P];
    const unsigned char* x;
    size_t row_bytes, scale_row_bytes;
};

template <int P>
__device__ __forceinline__ void item_src(int j, int n0, const u64_t (&wb)[P], const u64_t (&sb)[P], const bf16_t* x,
                                         long long x_slot_stride, int slot, int K, ItemSrc<P>& src) {
    src.row_bytes = K >> 1;
    src.scale_row_bytes = K >> 4;
#pragma unroll
    for (int p = 0; p < P; ++p) {
        src.w[p] = (const unsigned char*)__shfl_sync(0xffffffffu, wb[p], j) + (size_t)n0 * src.row_bytes;
        src.s[p] = (const unsigned char*)__shfl_sync(0xffffffffu, sb[p], j) + (size_t)n0 * src.scale_row_bytes;
    }
    src.x = (const unsigned char*)(x + __shfl_sync(0xffffffffu, slot, j) * x_slot_stride);
}

// Copy slab b of the item's weights and scales: 32 consecutive 16-byte pieces per instruction
// (rows of 64 T contiguous bytes).
template <int P, int T, int R>
__device__ __forceinline__ void issue_weights(RingStage<P, T, R>& st, const ItemSrc<P>& src, int b) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int p = 0; p < P; ++p) {
#pragma unroll
        for (int q = 0; q < 2 * T; ++q) {
            const int i = 32 * q + lane, r = i / (4 * T), j = i % (4 * T);
            cp_async16(smem_u32(&st.w[p][r][swz(r, j)]),
                       src.w[p] + (size_t)r * src.row_bytes + 64 * T * (size_t)b + 16 * j);
        }
        constexpr int SC = 8 * T;  // scale pieces: 16 rows x T / 2 (T = 2: fewer than a warp's lanes)
#pragma unroll
        for (int q = 0; q < (SC + 31) / 32; ++q) {
            const int i = 32 * q + lane, r = i / (T / 2), j = i % (T / 2);
            if (SC % 32 == 0 || i < SC)
                cp_async16(smem_u32(&st.s[p][r][j]),
                           src.s[p] + (size_t)r * src.scale_row_bytes + 8 * T * (size_t)b + 16 * j);
        }
    }
}

// Copy slab b of the item (decode: one x row).
template <int P, int T>
__device__ __forceinline__ void issue_slab(RingStage<P, T>& st, const ItemSrc<P>& src, int b) {
    const int lane = threadIdx.x & 31;
    issue_weights<P, T, 1>(st, src, b);
#pragma unroll
    for (int q = 0; q < T / 2; ++q)
        cp_async16(smem_u32(&st.x[0][32 * q + lane]), src.x + 256 * T * (size_t)b + 16 * (32 * q + lane));
}

// The slab's T steps: lane (g, t) takes chunk 4 s + t of rows g, g + 8 and of x row g (the mma's B
// column g; decode: only row 0, the other columns zero).
template <int P, int T, int R = 1>
__device__ __forceinline__ void consume_slab(const RingStage<P, T, R>& st, float (&acc)[P][4]) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int s = 0; s < T; ++s) {
        const int c = 4 * s + t;
        uint4 w[2 * P], xv[4];
        unsigned sc[2 * P];
#pragma unroll
        for (int p = 0; p < P; ++p) {
            w[2 * p] = st.w[p][g][swz(g, c)];
            w[2 * p + 1] = st.w[p][g + 8][swz(g + 8, c)];
            sc[2 * p] = ((const unsigned short*)&st.s[p][g][0])[c];
            sc[2 * p + 1] = ((const unsigned short*)&st.s[p][g + 8][0])[c];
        }
        const int r = g < R ? g : 0;
#pragma unroll
        for (int q = 0; q < 4; ++q) xv[q] = g < R ? st.x[r][xswz<R>(r, 4 * c + q)] : make_uint4(0u, 0u, 0u, 0u);
        mma_chunks<P>(w, sc, xv, acc);
    }
}

// The fp16 form of consume_slab (F = 1, nvfp4_mma.cuh): per step and matrix, 8 mmas with zero C
// whose 8 B columns split the work: column 2t + j holds x only for lane t's chunk, 16-k group j
// (lanes g = 2t + j carry it: b0 for j = 0, b1 for j = 1), so lane (g, t) gets back the partials of
// ITS chunk per row and group (d0: row g group 0, d1: row g group 1, d2 / d3: row g + 8), scales
// them by the chunk's own E4M3 scales and adds them to acc[p][0] (row g) and acc[p][1] (row g + 8).
// The four lanes of a quad are summed at the end of an item (finish_item).
template <int P, int T>
__device__ __forceinline__ void consume_slab_f16(const RingStage<P, T>& st, float (&acc)[P][4]) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3, j = g & 1;
    const unsigned keep = (g >> 1) == t ? 0xffffffffu : 0u, keep0 = j ? 0u : keep, keep1 = j ? keep : 0u;
#pragma unroll
    for (int s = 0; s < T; ++s) {
        const int c = 4 * s + t;
        const uint4 xa = st.x[0][4 * c + 2 * j], xb = st.x[0][4 * c + 2 * j + 1];  // k 16 j .. 16 j + 15 of the chunk
        const unsigned xw[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
        unsigned b0[8], b1[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const unsigned f = bf16x2_to_f16x2(xw[i]);
            b0[i] = f & keep0;
            b1[i] = f & keep1;
        }
#pragma unroll
        for (int p = 0; p < P; ++p) {
            unsigned lo[16], hi[16];  // rows n0 + g and n0 + g + 8
            decode_chunk_f16(st.w[p][g][swz(g, c)], lo);
            decode_chunk_f16(st.w[p][g + 8][swz(g + 8, c)], hi);
            float sg0, sg1, sh0, sh1;
            chunk_scales_f32(((const unsigned short*)&st.s[p][g][0])[c], sg0, sg1);
            chunk_scales_f32(((const unsigned short*)&st.s[p][g + 8][0])[c], sh0, sh1);
            float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
            for (int i = 0; i < 8; ++i) mma_f16(d, lo[i], hi[i], lo[8 + i], hi[8 + i], b0[i], b1[i]);
            acc[p][0] = fmaf(d[0], sg0, acc[p][0]);
            acc[p][0] = fmaf(d[1], sg1, acc[p][0]);
            acc[p][1] = fmaf(d[2], sh0, acc[p][1]);
            acc[p][1] = fmaf(d[3], sh1, acc[p][1]);
        }
    }
}

// F = 1: sum the quad's per-chunk partials into the bf16 form's layout (acc[p][0]: row g,
// acc[p][2]: row g + 8, on lanes t = 0).
template <int P, int F>
__device__ __forceinline__ void finish_item(float (&acc)[P][4]) {
    if constexpr (F != 0) {
#pragma unroll
        for (int p = 0; p < P; ++p) {
            float r0 = acc[p][0], r1 = acc[p][1];
            r0 += __shfl_xor_sync(0xffffffffu, r0, 1);
            r1 += __shfl_xor_sync(0xffffffffu, r1, 1);
            r0 += __shfl_xor_sync(0xffffffffu, r0, 2);
            r1 += __shfl_xor_sync(0xffffffffu, r1, 2);
            acc[p][0] = r0;
            acc[p][2] = r1;
        }
    }
}

// Outputs of one item (lanes t = 0 hold x row 0 of rows n0 + g, n0 + g + 8).
struct RingOut {
    bf16_t* out;  // P = 1
    bf16_t *gate, *up, *act;  // P = 2
    float limit;
};

template <int P>
__device__ __forceinline__ void store_item(const RingOut& o, int slot, int n0, int N, const float (&f)[P],
                                           const float (&acc)[P][4]) {
    if (threadIdx.x & 3) return;
    const size_t off = (size_t)slot * N;
    const int n = n0 + ((threadIdx.x & 31) >> 2);
    if (P == 1) {
        o.out[off + n] = f32_to_bf16(acc[0][0] * f[0]);
        o.out[off + n + 8] = f32_to_bf16(acc[0][2] * f[0]);
    } else {
        glu_store(o.gate + off, o.up + off, o.act + off, n, acc[0][0] * f[0], acc[P - 1][0] * f[P - 1], o.limit);
        glu_store(o.gate + off, o.up + off, o.act + off, n + 8, acc[0][2] * f[0], acc[P - 1][2] * f[P - 1], o.limit);
    }
}

// The per-warp cp.async pipeline of both ring forms. The warp's items are w0, w0 + W, ... < items,
// each `slabs` slabs; D - 1 slabs stay in flight ACROSS item boundaries. The steps are callables:
// src(item) points the producer at an item, issue(stage, slab) copies a slab of the producer's item,
// consume(stage) multiplies a landed slab into the caller's accumulators, finish(item) stores a
// finished item and clears them.
template <int D, typename Stage, typename Src, typename Issue, typename Consume, typename Finish>
__device__ __forceinline__ void ring_pipeline(Stage* ring, int w0, int W, int items, int slabs, Src&& src,
                                              Issue&& issue, Consume&& consume, Finish&& finish) {
    const int total = (w0 < items ? (items - w0 + W - 1) / W : 0) * slabs;  // this warp's slabs
    if (total == 0) return;
    int p_item = w0, p_s = 0;  // producer: (item, slab) of the next load
    src(p_item);
    auto advance = [&]() {
        if (++p_s < slabs) return;
        p_s = 0;
        p_item += W;
        if (p_item < items) src(p_item);
    };
#pragma unroll
    for (int d = 0; d < D - 1; ++d) {
        if (d < total) {
            issue(ring[d], p_s);
            advance();
        }
        cp_async_commit();
    }
    int c_item = w0, c_s = 0, stage = 0, fill = D - 1;
    for (int f = 0; f < total; ++f) {
        cp_async_wait<D - 2>();  // slab f has landed (this lane's copies)
        __syncwarp();            // ... and every lane's; every lane is done with slab f - 1's stage
        if (f + D - 1 < total) {
            issue(ring[fill], p_s);
            advance();
        }
        cp_async_commit();
        fill = fill + 1 == D ? 0 : fill + 1;
        consume(ring[stage]);
        stage = stage + 1 == D ? 0 : stage + 1;
        if (++c_s == slabs) {  // warp-uniform
            finish(c_item);
            c_s = 0;
            c_item += W;
        }
    }
}

template <int P>
__device__ __forceinline__ void zero_acc(float (&acc)[P][4]) {
#pragma unroll
    for (int p = 0; p < P; ++p)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[p][i] = 0.0f;
}

template <int P, int T, int D, int F>
__device__ __forceinline__ void ring_moe(const bf16_t* x, long long x_slot_stride, const u64_t* const (&wp)[P],
                                         const u64_t* const (&sp)[P], const float* const (&s2)[P], const int* ids,
                                         int S, int start, int count, const RingOut& o, int N, int K) {
    int my_slot;
    u64_t wb[P], sb[P];
    float fb[P];
    const int nlocal = local_slots<P>(ids, S, start, count, wp, sp, s2, my_slot, wb, sb, fb);
    const int groups = N >> 4;
    const int W = gridDim.x * RING_WARPS, w0 = blockIdx.x * RING_WARPS + (threadIdx.x >> 5);
    RingStage<P, T>* ring = reinterpret_cast<RingStage<P, T>*>(dyn_smem) + (threadIdx.x >> 5) * D;
    ItemSrc<P> src;
    float acc[P][4];
    zero_acc<P>(acc);
    ring_pipeline<D>(
        ring, w0, W, nlocal * groups, K / (128 * T),
        [&](int item) { item_src<P>(item / groups, (item % groups) * 16, wb, sb, x, x_slot_stride, my_slot, K, src); },
        [&](RingStage<P, T>& st, int b) { issue_slab<P, T>(st, src, b); },
        [&](const RingStage<P, T>& st) {
            if constexpr (F != 0) consume_slab_f16<P, T>(st, acc);
            else consume_slab<P, T>(st, acc);
        },
        [&](int item) {
            const int j = item / groups;
            float f2[P];
#pragma unroll
            for (int p = 0; p < P; ++p) f2[p] = __shfl_sync(0xffffffffu, fb[p], j);
            finish_item<P, F>(acc);
            store_item<P>(o, __shfl_sync(0xffffffffu, my_slot, j), (item % groups) * 16, N, f2, acc);
            zero_acc<P>(acc);
        });
}

// ---- the union form (verify, R = 2..8 rows): one sweep of each union expert for all its rows ----
// Work item i: (local union entry i / groups, sixteen weight rows). x row r of an entry is the
// mma's B column r; absent rows are zero-filled and not stored. The entry's row slots ride in one
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

// Copy slab b of a union item: the weights, then each x row's 256 T bytes (16 T pieces; one row per
// copy instruction, so its pointer is warp-uniform), zero-filled for an absent row.
template <int P, int T, int R>
__device__ __forceinline__ void issue_union_slab(RingStage<P, T, R>& st, const UnionSrc<P>& src, int b) {
    static_assert(16 * T % 32 == 0, "a copy instruction covers 32 pieces of one x row");
    const int lane = threadIdx.x & 31;
    issue_weights<P, T, R>(st, src.wsrc, b);
#pragma unroll
    for (int q = 0; q < R * 16 * T / 32; ++q) {
        const int i = 32 * q + lane, r = i / (16 * T), j = i % (16 * T);
        const bool here = (src.ent.present >> r) & 1u;
        const bf16_t* row = src.x + r * src.x_row_stride + (long long)((src.ent.slots >> (4 * r)) & 15u) * src.x_slot_stride;
        cp_async16_zfill(smem_u32(&st.x[r][xswz<R>(r, j)]), here ? (const void*)(row + 128 * T * (size_t)b + 8 * j)
                                                                  : (const void*)src.x, here);
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
                                           int N, int K) {
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
        ring, w0, W, nlocal * groups, K / (128 * T),
        [&](int item) { union_src<P, R>(item / groups, (item % groups) * 16, wb, sb, ents, K, src); },
        [&](RingStage<P, T, R>& st, int b) { issue_union_slab<P, T, R>(st, src, b); },
        [&](const RingStage<P, T, R>& st) { consume_slab<P, T, R>(st, acc); },
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

// Union entry points, R x rows staged (the wrapper rounds the group's `rows` up to 2, 4 or 8; rows
// past it are absent from every entry):
//   nvfp4_ring_union_gemv_r{R}_t{T}_d{D}   one projection; x [R, Kin] or per slot [R, top_k, Kin]
//   nvfp4_ring_union_glu_r{R}_t{T}_d{D}    gate + up + clamped SwiGLU fused
#define RING_UNION_ENTRIES(R, T, D)                                                                                 \
    static_assert(sizeof(RingStage<1, T, R>) == RING_STAGE_BYTES_P1_T##T##_R##R &&                                   \
                      sizeof(RingStage<2, T, R>) == RING_STAGE_BYTES_P2_T##T##_R##R,                                 \
                  "a union ring stage differs from ring_stage_bytes in glm_ep/backend/cuda/loader.py");            \
    extern "C" __global__ void __launch_bounds__(RING_THREADS) nvfp4_ring_union_gemv_r##R##_t##T##_d##D(             \
        const bf16_t* __restrict__ x, long long x_row_stride, long long x_slot_stride,                               \
        const u64_t* __restrict__ packed_ptrs, const u64_t* __restrict__ scale_ptrs, const float* __restrict__ scale2, \
        const int* __restrict__ u_eid, const int* __restrict__ u_slot, int U, int rows, int start, int count,       \
        bf16_t* __restrict__ out, long long out_row_stride, int N, int K) {                                          \
        const u64_t* const wp[1] = {packed_ptrs};                                                                   \
        const u64_t* const sp[1] = {scale_ptrs};                                                                    \
        const float* const s2[1] = {scale2};                                                                        \
        const RingOut o = {out, nullptr, nullptr, nullptr, 0.0f};                                                   \
        ring_union<1, T, D, R>(x, x_row_stride, x_slot_stride, wp, sp, s2, u_eid, u_slot, U, rows, start, count, o,  \
                               out_row_stride, N, K);                                                               \
    }                                                                                                               \
    extern "C" __global__ void __launch_bounds__(RING_THREADS) nvfp4_ring_union_glu_r##R##_t##T##_d##D(              \
        const bf16_t* __restrict__ x, long long x_row_stride, const u64_t* __restrict__ gate_packed,                 \
        const u64_t* __restrict__ gate_scale, const float* __restrict__ gate_scale2,                                \
        const u64_t* __restrict__ up_packed, const u64_t* __restrict__ up_scale, const float* __restrict__ up_scale2, \
        const int* __restrict__ u_eid, const int* __restrict__ u_slot, int U, int rows, int start, int count,       \
        bf16_t* __restrict__ gate, bf16_t* __restrict__ up, bf16_t* __restrict__ act, long long out_row_stride,      \
        int N, int K, float limit) {                                                                                \
        const u64_t* const wp[2] = {gate_packed, up_packed};                                                        \
        const u64_t* const sp[2] = {gate_scale, up_scale};                                                          \
        const float* const s2[2] = {gate_scale2, up_scale2};                                                        \
        const RingOut o = {nullptr, gate, up, act, limit};                                                          \
        ring_union<2, T, D, R>(x, x_row_stride, 0, wp, sp, s2, u_eid, u_slot, U, rows, start, count, o,             \
                               out_row_stride, N, K);                                                               \
    }

// Each slab's stage is the size the loader gives it (RING_STAGE_BYTES_P{P}_T{T}, from ring_stage_bytes).
#define RING_ENTRIES(T, D, F, TAG)                                                                                    \
    static_assert(sizeof(RingStage<1, T>) == RING_STAGE_BYTES_P1_T##T &&                                              \
                      sizeof(RingStage<2, T>) == RING_STAGE_BYTES_P2_T##T,                                            \
                  "a ring stage differs from ring_stage_bytes in glm_ep/backend/cuda/loader.py");                     \
    extern "C" __global__ void __launch_bounds__(RING_THREADS) nvfp4_ring_moe_gemv_##TAG##t##T##_d##D(                \
        const bf16_t* __restrict__ x, long long x_slot_stride, const u64_t* __restrict__ packed_ptrs,                 \
        const u64_t* __restrict__ scale_ptrs, const float* __restrict__ scale2, const int* __restrict__ ids, int S,   \
        int start, int count, bf16_t* __restrict__ out, int N, int K) {                                               \
        const u64_t* const wp[1] = {packed_ptrs};                                                                     \
        const u64_t* const sp[1] = {scale_ptrs};                                                                      \
        const float* const s2[1] = {scale2};                                                                          \
        const RingOut o = {out, nullptr, nullptr, nullptr, 0.0f};                                                     \
        ring_moe<1, T, D, F>(x, x_slot_stride, wp, sp, s2, ids, S, start, count, o, N, K);                            \
    }                                                                                                                 \
    extern "C" __global__ void __launch_bounds__(RING_THREADS) nvfp4_ring_moe_glu_##TAG##t##T##_d##D(                 \
        const bf16_t* __restrict__ x, const u64_t* __restrict__ gate_packed, const u64_t* __restrict__ gate_scale,    \
        const float* __restrict__ gate_scale2, const u64_t* __restrict__ up_packed,                                   \
        const u64_t* __restrict__ up_scale, const float* __restrict__ up_scale2, const int* __restrict__ ids, int S,  \
        int start, int count, bf16_t* __restrict__ gate, bf16_t* __restrict__ up, bf16_t* __restrict__ act, int N,    \
        int K, float limit) {                                                                                         \
        const u64_t* const wp[2] = {gate_packed, up_packed};                                                          \
        const u64_t* const sp[2] = {gate_scale, up_scale};                                                            \
        const float* const s2[2] = {gate_scale2, up_scale2};                                                          \
        const RingOut o = {nullptr, gate, up, act, limit};                                                            \
        ring_moe<2, T, D, F>(x, 0, wp, sp, s2, ids, S, start, count, o, N, K);                                        \
    }

RING_ENTRIES(4, 2, 0, )
RING_ENTRIES(4, 2, 1, f16_)
RING_ENTRIES(4, 3, 0, )
RING_ENTRIES(4, 3, 1, f16_)
RING_ENTRIES(4, 4, 0, )
RING_ENTRIES(4, 4, 1, f16_)
RING_ENTRIES(8, 2, 0, )
RING_ENTRIES(8, 2, 1, f16_)
RING_ENTRIES(8, 3, 0, )
RING_ENTRIES(8, 3, 1, f16_)
RING_UNION_ENTRIES(2, 2, 3)
RING_UNION_ENTRIES(4, 2, 3)
RING_UNION_ENTRIES(8, 2, 3)
RING_UNION_ENTRIES(2, 4, 2)
RING_UNION_ENTRIES(4, 4, 2)
RING_UNION_ENTRIES(8, 4, 2)
