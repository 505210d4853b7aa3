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
// NumPy twin: NumpyBackend.moe_gemv, moe_gate_up_act and moe_down_shared_combine
// (glm_ep/backend/numpy_backend.py); held together by tests/cuda/test_cuda_ring.py (every form, the fused
// down + shared + combine launch, the placed form's scaling) and tests/cuda/test_cuda_paths.py (the sites).
//
// Numerics (consume_slab_unscaled): each 16-k group's fp32 partial is scaled by its E4M3 block scale and the
// groups summed in k order within a lane, the quad's four partials at the end of an item, then one bf16
// rounding per output. Requires K % (128 T) == 0 and N % 16 == 0 (cuda/ring.py sends other shapes to
// gemv_nvfp4.cu). Work item i is local slot i / groups, rows 16 (i % groups) ..; warp w takes item w, then
// w + W, w + 2W, ... (W warps in the grid) or, with the launch's claim counter, the items it hands out
// (nvfp4_ring.cuh's ring_pipeline). A slot whose expert id is outside [start, start + count) is not an item and its
// output is left untouched.
//
// Entry points, T = steps per slab, D = ring depth (grid (blocks), RING_WARPS warps per block, D
// stages of ring_stage_bytes(P, T) per warp of dynamic shared memory; computed in cuda/ring.py), each in
// the operand forms of RingConfig.forms (FORM: bf16u_, f16_, pl_):
//   nvfp4_ring_moe_gemv_{FORM}t{T}_d{D}   one projection, x[0] or x[slot]            P = 1
//   nvfp4_ring_moe_glu_{bf16u_,f16_}t{T}_d{D}   gate + up + clamped SwiGLU fused     P = 2
//   nvfp4_ring_moe_down_combine_{FORM}t{T}_d{D}  the down projection (x[slot]) with the shared expert's down
//       projection and the site's combine in the same launch (DownCombine, ring_down_combine.cuh)
// The forms: bf16u_ (F = 2) the unscaled e2m1 as bf16 operands, x as it is: exact for any bf16 input;
// f16_ (F = 1) the same with fp16 operands, x rounded to fp16 (exact while |x| <= 65504); pl_ (F = 3, the
// down projection) the bf16u form with the weights decoded by bit placement (e2m1 x 2^-126) and x paired to
// match and scaled by 2^xshift, the caller's bound on the activation (ring.act_shift).
// The verify (union) kernels on the same ring are gemv_nvfp4_union.cu's; what both share is in
// nvfp4_ring.cuh.
#include "common.cuh"
#include "nvfp4_mma.cuh"
#include "async_copy.cuh"
#include "nvfp4_ring.cuh"
#include "ring_down_combine.cuh"

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

// Copy slab b of the item (decode: one x row).
template <int P, int T>
__device__ __forceinline__ void issue_slab(RingStage<P, T>& st, const ItemSrc<P>& src, int b) {
    const int lane = threadIdx.x & 31;
    issue_weights<P, T, 1>(st, src, b);
#pragma unroll
    for (int q = 0; q < T / 2; ++q)
        cp_async16(smem_u32(&st.x[0][32 * q + lane]), src.x + 256 * T * (size_t)b + 16 * (32 * q + lane));
}

// The unscaled forms of consume_slab (nvfp4_mma.cuh): F = 1, fp16 operands (x rounded to fp16); F = 2,
// bf16 operands (x as it is). Per step and matrix, 8 mmas with zero C whose 8 B columns split the
// work: column 2t + j holds x only for lane t's chunk, 16-k group j (lanes g = 2t + j carry it: b0 for
// j = 0, b1 for j = 1), so lane (g, t) gets back the partials of ITS chunk per row and group (d0: row g
// group 0, d1: row g group 1, d2 / d3: row g + 8), scales them by the chunk's own E4M3 scales and adds
// them to acc[p][0] (row g) and acc[p][1] (row g + 8). The four lanes of a quad are summed at the end of
// an item (finish_item). F = 3: x paired and scaled by xs2 = 2^xshift as the placed weights need it.
template <int P, int T, int F>
__device__ __forceinline__ void consume_slab_unscaled(const RingStage<P, T>& st, float (&acc)[P][4], unsigned xs2) {
    static_assert(F >= 1 && F <= 3, "the unscaled forms are fp16 (1), bf16 (2) and placed bf16 (3)");
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3, j = g & 1;
    const unsigned keep = (g >> 1) == t ? 0xffffffffu : 0u, keep0 = j ? 0u : keep, keep1 = j ? keep : 0u;
#pragma unroll
    for (int s = 0; s < T; ++s) {
        const int c = 4 * s + t;
        const uint4 x0 = st.x[0][4 * c + 2 * j];  // k 16 j .. 16 j + 15 of the chunk
        const uint4 x1 = st.x[0][4 * c + 2 * j + 1];
        unsigned xw[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
        if constexpr (F == 3) {  // x as the placed pairs, times 2^xshift (exact)
            const unsigned nat[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
            placed_x8(nat, xs2, xw);
            placed_x8(nat + 4, xs2, xw + 4);
        }
        unsigned b0[8], b1[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const unsigned f = F == 1 ? bf16x2_to_f16x2(xw[i]) : xw[i];
            b0[i] = f & keep0;
            b1[i] = f & keep1;
        }
#pragma unroll
        for (int p = 0; p < P; ++p) {
            unsigned lo[16], hi[16];  // rows n0 + g and n0 + g + 8
            if constexpr (F == 1) {
                decode_chunk_f16(st.w[p][g][swz(g, c)], lo);
                decode_chunk_f16(st.w[p][g + 8][swz(g + 8, c)], hi);
            } else if constexpr (F == 2) {
                decode_chunk_bf16u(st.w[p][g][swz(g, c)], lo);
                decode_chunk_bf16u(st.w[p][g + 8][swz(g + 8, c)], hi);
            } else {
                decode_chunk_placed(st.w[p][g][swz(g, c)], lo);
                decode_chunk_placed(st.w[p][g + 8][swz(g + 8, c)], hi);
            }
            float sg0, sg1, sh0, sh1;
            chunk_scales_f32(((const unsigned short*)&st.s[p][g][0])[c], sg0, sg1);
            chunk_scales_f32(((const unsigned short*)&st.s[p][g + 8][0])[c], sh0, sh1);
            float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                if constexpr (F == 1) mma_f16(d, lo[i], hi[i], lo[8 + i], hi[8 + i], b0[i], b1[i]);
                else mma_bf16(d, lo[i], hi[i], lo[8 + i], hi[8 + i], b0[i], b1[i]);
            }
            acc[p][0] = fmaf(d[0], sg0, acc[p][0]);
            acc[p][0] = fmaf(d[1], sg1, acc[p][0]);
            acc[p][1] = fmaf(d[2], sh0, acc[p][1]);
            acc[p][1] = fmaf(d[3], sh1, acc[p][1]);
        }
    }
}

// Sum the quad's per-chunk partials (acc[p][0]: row g, acc[p][2]: row g + 8, on lanes t = 0).
template <int P>
__device__ __forceinline__ void finish_item(float (&acc)[P][4]) {
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

// The placed form's shift for x row `x` (placed_shift), where the caller gives no bound (xshift < 0): every
// lane of the warp reads the whole row (K % 8 == 0) and gets the same shift.
__device__ __forceinline__ int row_shift(const bf16_t* x, int K) {
    const unsigned m = abs_max_bits(reinterpret_cast<const uint4*>(x), threadIdx.x & 31, 32, K / 8);
    return placed_shift(__reduce_max_sync(0xffffffffu, m));
}

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

// DC: the routed items of down projection (P = 1) follow groups * dc.parts shared items, and every item
// ends in arrive_and_combine.
// xshift (F = 3, the down projection): the power of two the caller bounds x by (ring.act_shift), or -1 where
// it has none: x is one row (x_slot_stride 0) and the kernel takes the shift from it.
// The placed form's sums are the unscaled bf16 form's times 2^(xshift - 127): a finished item's sums are
// multiplied back by 2^(127 - xshift) (exact; in two factors past 2^127) before the same output scale
// (scale_2 x 128), so they overflow exactly where the unscaled form's do. The down projection's bound
// (act_shift) holds only for a clamped SwiGLU of the site's limit: a larger input would become inf.
template <int P, int T, int D, int F, bool DC = false>
__device__ __forceinline__ void ring_moe(const bf16_t* x, long long x_slot_stride, const u64_t* const (&wp)[P],
                                         const u64_t* const (&sp)[P], const float* const (&s2)[P], const int* ids,
                                         int S, int start, int count, const RingOut& o, int N, int K,
                                         unsigned* claims, const DownCombine& dc = DownCombine{}, int xshift = 0) {
    static_assert(!DC || P == 1, "the combine ends the down projection");
    static_assert(F >= 1 && F <= 3 && (F != 3 || P == 1), "the forms: f16 (1), bf16u (2), placed down (3)");
    float pre = 1.0f, pre2 = 1.0f;  // F = 3: set by the pipeline's start, once the first copies are in flight
    unsigned xs2 = 0u;
    int my_slot;
    u64_t wb[P], sb[P];
    float fb[P];
    const int nlocal = local_slots<P>(ids, S, start, count, wp, sp, s2, my_slot, wb, sb, fb);
    const int groups = N >> 4, slabs = K / (128 * T);
    const int shared_items = DC ? groups * dc.parts : 0;
    const int W = gridDim.x * RING_WARPS, w0 = blockIdx.x * RING_WARPS + (threadIdx.x >> 5);
    RingStage<P, T>* ring = reinterpret_cast<RingStage<P, T>*>(dyn_smem) + (threadIdx.x >> 5) * D;
    ItemSrc<P> src;
    bool src_shared = false;  // the producer's item is a shared one
    float acc[P][4];
    zero_acc<P>(acc);
    ring_pipeline<D>(
        ring, w0, W, shared_items + nlocal * groups, slabs, claims,
        [&](int item) {
            src_shared = DC && item < shared_items;
            if (src_shared) {
                const int kp = 32 * T * slabs, part = item / groups, n0 = (item % groups) * 16;
                src.w[0] = (const unsigned char*)(dc.sh_w + (size_t)n0 * dc.sh_k + (size_t)part * kp);
                src.row_bytes = 2 * (size_t)dc.sh_k;
                src.x = (const unsigned char*)(dc.sh_x + (size_t)part * kp);
            } else {
                const int r = item - shared_items;
                item_src<P>(r / groups, (r % groups) * 16, wb, sb, x, x_slot_stride, my_slot, K, src);
            }
        },
        [&](RingStage<P, T>& st, int b) {
            if constexpr (DC) {
                if (src_shared) {
                    issue_bf16_slab<T>(st, src, b);
                    return;
                }
            }
            issue_slab<P, T>(st, src, b);
        },
        [&](const RingStage<P, T>& st, int item, int) {
            if constexpr (DC) {
                if (item < shared_items) {
                    consume_bf16_slab<T>(st, acc);
                    return;
                }
            }
            consume_slab_unscaled<P, T, F>(st, acc, xs2);
        },
        [&](int item) {
            if (DC && item < shared_items) {
                const int n = (item % groups) * 16 + ((threadIdx.x & 31) >> 2);
                if ((threadIdx.x & 3) == 0) {
                    float* part = dc.partials + (size_t)(item / groups) * N;
                    part[n] = acc[0][0];
                    part[n + 8] = acc[0][2];
                }
                zero_acc<P>(acc);
                arrive_and_combine(dc, o.out, S, N, (item % groups) * 16, nlocal + dc.parts);
                return;
            }
            const int r = item - shared_items, j = r / groups;
            float f2[P];
#pragma unroll
            for (int p = 0; p < P; ++p) f2[p] = __shfl_sync(0xffffffffu, fb[p], j);
            finish_item<P>(acc);
            if constexpr (F == 3) {
#pragma unroll
                for (int p = 0; p < P; ++p) acc[p][0] = acc[p][0] * pre * pre2, acc[p][2] = acc[p][2] * pre * pre2;
            }
            store_item<P>(o, __shfl_sync(0xffffffffu, my_slot, j), (r % groups) * 16, N, f2, acc);
            zero_acc<P>(acc);
            if constexpr (DC) arrive_and_combine(dc, o.out, S, N, (r % groups) * 16, nlocal + dc.parts);
        },
        [&]() {
            if constexpr (F == 3) {
                if (xshift < 0) xshift = row_shift(x, K);
                const int t = 127 - xshift;  // 0 .. 135
                pre = exp2i(t > 127 ? 127 : t);
                pre2 = exp2i(t > 127 ? t - 127 : 0);
                xs2 = exp2i_bf16x2(xshift);
            }
        });
}

// Each slab's stage is the size the loader gives it (RING_STAGE_BYTES_P{P}_T{T}, from ring_stage_bytes).
#define RING_ONE_ENTRIES(T, D, F, TAG)                                                                                \
    static_assert(sizeof(RingStage<1, T>) == RING_STAGE_BYTES_P1_T##T &&                                              \
                      sizeof(RingStage<2, T>) == RING_STAGE_BYTES_P2_T##T,                                            \
                  "a ring stage differs from ring_stage_bytes in glm_ep/backend/cuda/kernel_loader.py");              \
    extern "C" __global__ void __launch_bounds__(RING_THREADS) nvfp4_ring_moe_gemv_##TAG##t##T##_d##D(                \
        const bf16_t* __restrict__ x, long long x_slot_stride, const u64_t* __restrict__ packed_ptrs,                 \
        const u64_t* __restrict__ scale_ptrs, const float* __restrict__ scale2, const int* __restrict__ ids, int S,   \
        int start, int count, bf16_t* __restrict__ out, int N, int K, int xshift, unsigned* claims) {                 \
        pdl_enter();                                                                                                  \
        const u64_t* const wp[1] = {packed_ptrs};                                                                     \
        const u64_t* const sp[1] = {scale_ptrs};                                                                      \
        const float* const s2[1] = {scale2};                                                                          \
        const RingOut o = {out, nullptr, nullptr, nullptr, 0.0f};                                                     \
        ring_moe<1, T, D, F>(x, x_slot_stride, wp, sp, s2, ids, S, start, count, o, N, K, claims, DownCombine{},      \
                             xshift);                                                                                 \
    }                                                                                                                 \
    extern "C" __global__ void __launch_bounds__(RING_THREADS) nvfp4_ring_moe_down_combine_##TAG##t##T##_d##D(        \
        const bf16_t* __restrict__ x, const u64_t* __restrict__ packed_ptrs, const u64_t* __restrict__ scale_ptrs,    \
        const float* __restrict__ scale2, const int* __restrict__ ids, int S, int start, int count, bf16_t* routed,   \
        int N, int K, const bf16_t* __restrict__ sh_w, const bf16_t* __restrict__ sh_x, int sh_k, int parts,          \
        float* partials, unsigned* arrived, const float* __restrict__ wts, bf16_t* __restrict__ out, int xshift,      \
        unsigned* claims) {                                                                                           \
        pdl_enter();                                                                                                  \
        const u64_t* const wp[1] = {packed_ptrs};                                                                     \
        const u64_t* const sp[1] = {scale_ptrs};                                                                      \
        const float* const s2[1] = {scale2};                                                                          \
        const RingOut o = {routed, nullptr, nullptr, nullptr, 0.0f};                                                  \
        const DownCombine dc = {sh_w, sh_x, sh_k, parts, partials, arrived, wts, out};                                \
        ring_moe<1, T, D, F, true>(x, K, wp, sp, s2, ids, S, start, count, o, N, K, claims, dc, xshift);              \
    }

#define RING_GLU_ENTRY(T, D, F, TAG)                                                                                  \
    static_assert(sizeof(RingStage<2, T>) == RING_STAGE_BYTES_P2_T##T,                                                \
                  "a ring stage differs from ring_stage_bytes in glm_ep/backend/cuda/kernel_loader.py");              \
    extern "C" __global__ void __launch_bounds__(RING_THREADS) nvfp4_ring_moe_glu_##TAG##t##T##_d##D(                 \
        const bf16_t* __restrict__ x, const u64_t* __restrict__ gate_packed, const u64_t* __restrict__ gate_scale,    \
        const float* __restrict__ gate_scale2, const u64_t* __restrict__ up_packed,                                   \
        const u64_t* __restrict__ up_scale, const float* __restrict__ up_scale2, const int* __restrict__ ids, int S,  \
        int start, int count, bf16_t* __restrict__ gate, bf16_t* __restrict__ up, bf16_t* __restrict__ act, int N,    \
        int K, float limit, unsigned* claims) {                                                                       \
        pdl_enter();                                                                                                  \
        const u64_t* const wp[2] = {gate_packed, up_packed};                                                          \
        const u64_t* const sp[2] = {gate_scale, up_scale};                                                            \
        const float* const s2[2] = {gate_scale2, up_scale2};                                                          \
        const RingOut o = {nullptr, gate, up, act, limit};                                                            \
        ring_moe<2, T, D, F>(x, 0, wp, sp, s2, ids, S, start, count, o, N, K, claims);                                \
    }

// The forms RingConfig.forms picks (cuda/ring.py): gate + up in bf16u or f16, the down projection in those or
// placed; one geometry for one projection (RING_KERNELS), three for gate + up (RING_GLU_KERNELS: slab 2 fits more
// warps an SM).
RING_ONE_ENTRIES(4, 2, 1, f16_)
RING_ONE_ENTRIES(4, 2, 2, bf16u_)
RING_ONE_ENTRIES(4, 2, 3, pl_)
RING_GLU_ENTRY(4, 2, 1, f16_)
RING_GLU_ENTRY(4, 2, 2, bf16u_)
RING_GLU_ENTRY(2, 3, 1, f16_)
RING_GLU_ENTRY(2, 3, 2, bf16u_)
RING_GLU_ENTRY(2, 2, 1, f16_)
RING_GLU_ENTRY(2, 2, 2, bf16u_)
