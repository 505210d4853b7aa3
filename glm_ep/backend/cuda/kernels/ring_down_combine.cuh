// The down ring's fused tail (gemv_nvfp4_ring.cu, DC = true): the shared expert's down projection as
// extra ring items and the site's combine by the warp that finishes a row group. Include after
// common.cuh, nvfp4_mma.cuh, async_copy.cuh and nvfp4_ring.cuh.
//
// NumPy twin: NumpyBackend.moe_down_shared_combine (glm_ep/backend/numpy_backend.py); held together by
// tests/cuda/test_cuda_ring.py::test_moe_down_combine_ring and its fallback test.
#pragma once

// The shared expert's bf16 down weights [N, Ksh] run as extra items of the down ring: item (part, group)
// is 16 rows by Kp = 32 T * slabs k (Ksh = parts * Kp), a slab 32 T k (the 64 T bytes a stage row
// holds), the same slab count as a routed item. Its fp32 sums go to partials[part][n]. Every finished
// item (routed or shared) of a row group counts itself in arrived[group]; the warp that brings the
// count to nlocal + parts combines the group's 16 rows: shared = bf16(partials summed in part order),
// out = bf16(fp32 sum over slots k in order of wts[k] * routed[k], + shared), elementwise.cu's combine
// (remote slots read as the zeros written before the launch), and clears the count for the next launch.
// No residual: the stack adds it.
struct DownCombine {
    const bf16_t* sh_w;  // [N, sh_k] the shared expert's down projection (this rank's TP slice)
    const bf16_t* sh_x;  // [sh_k] its activations
    int sh_k, parts;
    float* partials;     // [parts, N]
    unsigned* arrived;   // [N / 16], zero between launches
    const float* wts;    // [S] the combine weights of the row
    bf16_t* out;         // [N] the site's output row
};

// Slab b of a shared item: 16 rows x 32 T k of bf16 weights (no scales) and the 32 T k of x.
template <int T>
__device__ __forceinline__ void issue_bf16_slab(RingStage<1, T>& st, const ItemSrc<1>& src, int b) {
    const int lane = threadIdx.x & 31;
    issue_weights<1, T, 1, false>(st, src, b);
    if (lane < 4 * T) cp_async16(smem_u32(&st.x[0][lane]), src.x + 64 * T * (size_t)b + 16 * lane);
}

// A landed bf16 slab into the bf16 form's layout (acc[0][0]: row g, acc[0][2]: row g + 8, lanes t = 0):
// lane (g, t) takes pieces (8 k each) 4 q + t of rows g and g + 8, as the NVFP4 form takes chunks, and
// x row 0 is the mma's B column 0.
template <int T>
__device__ __forceinline__ void consume_bf16_slab(const RingStage<1, T>& st, float (&acc)[1][4]) {
    static_assert(T % 4 == 0, "a shared slab is T / 4 steps of four 8-k pieces per lane");
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int u = 0; u < T / 4; ++u) {
        unsigned lo[16], hi[16];
        uint4 xv[4];
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            const int j = 4 * (4 * u + q) + t;
            const uint4 a = st.w[0][g][swz(g, j)], b = st.w[0][g + 8][swz(g + 8, j)];
            lo[4 * q] = a.x, lo[4 * q + 1] = a.y, lo[4 * q + 2] = a.z, lo[4 * q + 3] = a.w;
            hi[4 * q] = b.x, hi[4 * q + 1] = b.y, hi[4 * q + 2] = b.z, hi[4 * q + 3] = b.w;
            xv[q] = g == 0 ? st.x[0][j] : make_uint4(0u, 0u, 0u, 0u);
        }
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const uint4& x4 = xv[i >> 1];
            mma_bf16(acc[0], lo[2 * i], hi[2 * i], lo[2 * i + 1], hi[2 * i + 1], (i & 1) ? x4.z : x4.x,
                     (i & 1) ? x4.w : x4.y);
        }
    }
}

// The fp32 sum of term(0) .. term(n - 1) in that order from 0, in rounds of 8 whose terms (reads) are all issued
// before the round's adds: one memory round trip a round instead of one a term.
template <class Term>
__device__ __forceinline__ float sum_in_rounds(int n, Term term) {
    float s = 0.0f;
    for (int i0 = 0; i0 < n; i0 += 8) {
        float v[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) v[i] = i0 + i < n ? term(i0 + i) : 0.0f;
#pragma unroll
        for (int i = 0; i < 8; ++i)
            if (i0 + i < n) s = __fadd_rn(s, v[i]);
    }
    return s;
}

// A finished item of row group n0 / 16 has been stored: count it, and combine the group if it is the last.
__device__ __forceinline__ void arrive_and_combine(const DownCombine& dc, const bf16_t* routed, int S, int N, int n0,
                                                   unsigned expected) {
    const int lane = threadIdx.x & 31;
    __syncwarp();  // every lane's stores happen before lane 0's release (cumulative)
    unsigned before = 0u;
    if (lane == 0)
        asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;" : "=r"(before) : "l"(dc.arrived + (n0 >> 4))
                     : "memory");
    if (__shfl_sync(0xffffffffu, before, 0) + 1u != expected) return;  // the same on every lane
    __syncwarp();  // lane 0's acquire before every lane's reads below (a shuffle orders no memory)
    if (lane < 16) {
        const int n = n0 + lane;
        const float sh = sum_in_rounds(dc.parts, [&](int p) { return __ldcg(dc.partials + (size_t)p * N + n); });
        const float acc = sum_in_rounds(S, [&](int k) {
            return __fmul_rn(dc.wts[k], bf16_to_f32(__ldcg(routed + (size_t)k * N + n)));
        });
        dc.out[n] = f32_to_bf16(__fadd_rn(acc, round_bf16(sh)));
    }
    if (lane == 0) dc.arrived[n0 >> 4] = 0u;
}
