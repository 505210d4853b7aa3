// Dense GEMV for 1..8 rows of bf16 x: out[r, n] = sum_k x[r, k] * w[n, k] with fp32
// accumulation; every weight is read ONCE for all rows (the batch-M tier of a verify step).
//
// A block is GEMV_WARPS warps. `ksplit` consecutive warps share a row group, each summing a
// contiguous slice of K; the slices meet in shared memory and are added in slice order. A row
// group is GEMV_ROWS_PER_WARP rows of one matrix, or, fused, row n of gate and row n of up.
// Lane l owns the 8-k chunks lo + l, lo + l + 32, ... of its slice (16-byte streaming weight
// loads); x is read from global memory in the same pattern (L1 serves all but the first warp).
// K must be a multiple of 8.
//
// Entry points, R = 1..8 (grids computed in glm_ep/backend/cuda/dense.py):
//   bf16_gemv_r{R}          bf16 weights, bf16 out (the backend's `linear`)
//   bf16_glu_r{R}           gate and up fused, writing gate, up and the clamped SwiGLU
//   router_gemv_bf16w_r{R}  bf16 router weights, fp32 logits
//   router_gemv_f32w_r{R}   fp32 router weights, fp32 logits
//   bf16_gemv_combine_r{R}  the shared expert's down projection ending in the site's combine:
//       out[r, n] = bf16(sum_k wts[r, k] * routed[r K + k, n] + bf16(down(act)[r, n])), elementwise.cu's
//       combine (slots in order, each product rounded before its add) on the GEMV's bf16 output
//   router_topk_{bf16w,f32w}_r{R}  the router GEMV and its top-k in ONE launch: every block writes its
//       logits, and the block that finishes last (a device counter, reset by that block for the next
//       launch) runs router_topk.cuh on all R rows, one warp per row (dynamic shared memory 8 E R bytes)
//   router_topk_glu_{bf16w,f32w}_r{R}  router_topk_* and bf16_glu_r{R} on the same x in ONE launch (the
//       shared expert's gate + up beside the router): the router's blocks first, then the GLU's
//
// NumPy twin: NumpyBackend.linear, gate_up_act, router_logits, route, route_and_gate_up_act and shared_down_combine
// (glm_ep/backend/numpy_backend.py); held together by tests/cuda/test_cuda_dense.py, test_cuda_router.py and
// test_cuda_elementwise.py::test_shared_down_combine (each at 5..8 rows with the warp-streaming GEMM off too).
#include "common.cuh"
#include "router_topk.cuh"

#ifndef GEMV_WARPS
#error "GEMV_WARPS is set by glm_ep/backend/cuda/kernel_loader.py"
#endif
#ifndef GEMV_ROWS_PER_WARP
#error "GEMV_ROWS_PER_WARP is set by glm_ep/backend/cuda/kernel_loader.py"
#endif
#define GEMV_THREADS (GEMV_WARPS * 32)

// 8 weights of one chunk, widened.
template <typename WT>
__device__ __forceinline__ void widen_chunk(const uint4 (&v)[sizeof(WT) / 2], float (&f)[8]) {
    if (sizeof(WT) == 2) {
        f[0] = bf16_lo(v[0].x); f[1] = bf16_hi(v[0].x); f[2] = bf16_lo(v[0].y); f[3] = bf16_hi(v[0].y);
        f[4] = bf16_lo(v[0].z); f[5] = bf16_hi(v[0].z); f[6] = bf16_lo(v[0].w); f[7] = bf16_hi(v[0].w);
    } else {
        f[0] = __uint_as_float(v[0].x); f[1] = __uint_as_float(v[0].y);
        f[2] = __uint_as_float(v[0].z); f[3] = __uint_as_float(v[0].w);
        f[4] = __uint_as_float(v[sizeof(WT) / 2 - 1].x); f[5] = __uint_as_float(v[sizeof(WT) / 2 - 1].y);
        f[6] = __uint_as_float(v[sizeof(WT) / 2 - 1].z); f[7] = __uint_as_float(v[sizeof(WT) / 2 - 1].w);
    }
}

// P weight rows (nullptr: past N, read as zeros) over chunks [c_lo, c_hi), R x rows; returns the
// warp-reduced sums in every lane.
template <int P, int R, typename WT>
__device__ __forceinline__ void gemv_warp(const WT* const (&w)[P], const bf16_t* x, long long x_row_stride,
                                          int c_lo, int c_hi, float (&acc)[P][R]) {
    constexpr int NV = sizeof(WT) / 2;  // 16-byte vectors per chunk
    constexpr int U = R <= 2 ? 4 : 2;
#pragma unroll
    for (int p = 0; p < P; ++p)
#pragma unroll
        for (int r = 0; r < R; ++r) acc[p][r] = 0.0f;
    for (int c0 = c_lo + (threadIdx.x & 31); c0 < c_hi; c0 += 32 * U) {
        uint4 wv[U][P][NV];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int c = c0 + 32 * u;
#pragma unroll
            for (int p = 0; p < P; ++p)
#pragma unroll
                for (int v = 0; v < NV; ++v)
                    wv[u][p][v] = (c < c_hi && w[p]) ? ld_stream_v4(w[p] + 8 * (size_t)c + v * (16 / sizeof(WT)))
                                                     : make_uint4(0u, 0u, 0u, 0u);
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int c = c0 + 32 * u;
            if (c >= c_hi) break;
            float wf[P][8];
#pragma unroll
            for (int p = 0; p < P; ++p) widen_chunk<WT>(wv[u][p], wf[p]);
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const uint4 xv = ld_cached_v4(x + r * x_row_stride + 8 * (size_t)c);
                float xf[8];
                xf[0] = bf16_lo(xv.x); xf[1] = bf16_hi(xv.x); xf[2] = bf16_lo(xv.y); xf[3] = bf16_hi(xv.y);
                xf[4] = bf16_lo(xv.z); xf[5] = bf16_hi(xv.z); xf[6] = bf16_lo(xv.w); xf[7] = bf16_hi(xv.w);
#pragma unroll
                for (int p = 0; p < P; ++p)
#pragma unroll
                    for (int j = 0; j < 8; ++j) acc[p][r] = fmaf(wf[p][j], xf[j], acc[p][r]);
            }
        }
    }
#pragma unroll
    for (int p = 0; p < P; ++p)
#pragma unroll
        for (int r = 0; r < R; ++r) acc[p][r] = warp_sum(acc[p][r]);
}

// The row group's K slices added in order; true in the warp that then holds the totals.
template <int P, int R>
__device__ __forceinline__ bool ksplit_sum(float (&acc)[P][R], int ksplit) {
    __shared__ float red[GEMV_WARPS][P * R];
    if (ksplit == 1) return true;
    const int warp = threadIdx.x >> 5;
    if ((threadIdx.x & 31) == 0) {
#pragma unroll
        for (int p = 0; p < P; ++p)
#pragma unroll
            for (int r = 0; r < R; ++r) red[warp][p * R + r] = acc[p][r];
    }
    __syncthreads();
    if (warp % ksplit) return false;
#pragma unroll
    for (int p = 0; p < P; ++p)
#pragma unroll
        for (int r = 0; r < R; ++r) {
            float s = red[warp][p * R + r];
            for (int j = 1; j < ksplit; ++j) s += red[warp + j][p * R + r];
            acc[p][r] = s;
        }
    return true;
}

struct Slice {
    int group, c_lo, c_hi;
};

// ``block``: the block's index among the blocks of its GEMV (blockIdx.x, less the blocks of another
// GEMV sharing the launch).
__device__ __forceinline__ Slice slice_of(int K, int ksplit, int block) {
    const int warp = threadIdx.x >> 5, ks = warp % ksplit;
    const int nchunk = K >> 3, per = (nchunk + ksplit - 1) / ksplit;
    const int lo = min(nchunk, ks * per);
    return Slice{block * (GEMV_WARPS / ksplit) + warp / ksplit, lo, min(nchunk, lo + per)};
}

__device__ __forceinline__ void store(bf16_t* p, float v) { *p = f32_to_bf16(v); }
__device__ __forceinline__ void store(float* p, float v) { *p = v; }

// R rows x GEMV_ROWS_PER_WARP weight rows per row group; the lane owning output (r, n) after the
// K-slice sum calls done(r, n, sum) (lanes p R + r of the group's first warp, n = n0 + p < N).
template <int R, typename WT, typename Done>
__device__ __forceinline__ void gemv_rows(const bf16_t* x, long long x_row_stride, const WT* w, int N, int K,
                                          int ksplit, int block, Done&& done) {
    constexpr int P = GEMV_ROWS_PER_WARP;
    const Slice s = slice_of(K, ksplit, block);
    const int n0 = s.group * P;
    const WT* rows[P];
#pragma unroll
    for (int p = 0; p < P; ++p) rows[p] = n0 + p < N ? w + (size_t)(n0 + p) * K : nullptr;
    float acc[P][R];
    gemv_warp<P, R, WT>(rows, x, x_row_stride, s.c_lo, s.c_hi, acc);
    if (!ksplit_sum<P, R>(acc, ksplit)) return;
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int p = 0; p < P; ++p)
#pragma unroll
        for (int r = 0; r < R; ++r)
            if (lane == p * R + r && n0 + p < N) done(r, n0 + p, acc[p][r]);
}

template <int R, typename WT, typename OT>
__device__ __forceinline__ void gemv_plain(const bf16_t* x, long long x_row_stride, const WT* w, OT* out,
                                           long long out_row_stride, int N, int K, int ksplit, int block) {
    gemv_rows<R, WT>(x, x_row_stride, w, N, K, ksplit, block,
                     [&](int r, int n, float v) { store(out + r * out_row_stride + n, v); });
}

template <int R>
__device__ __forceinline__ void gemv_glu(const bf16_t* x, long long x_row_stride, const bf16_t* wg,
                                         const bf16_t* wu, bf16_t* gate, bf16_t* up, bf16_t* act,
                                         long long out_row_stride, int N, int K, int ksplit, float limit,
                                         int block) {
    const Slice s = slice_of(K, ksplit, block);
    const int n = s.group;
    const bf16_t* rows[2] = {n < N ? wg + (size_t)n * K : nullptr, n < N ? wu + (size_t)n * K : nullptr};
    float acc[2][R];
    gemv_warp<2, R, bf16_t>(rows, x, x_row_stride, s.c_lo, s.c_hi, acc);
    if (!ksplit_sum<2, R>(acc, ksplit)) return;
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int r = 0; r < R; ++r) {
        if (lane == r && n < N) {
            const long long o = r * out_row_stride + n;
            const bf16_t g = f32_to_bf16(acc[0][r]), u = f32_to_bf16(acc[1][r]);
            gate[o] = g;
            up[o] = u;
            act[o] = swiglu_one(bf16_to_f32(g), bf16_to_f32(u), limit);
        }
    }
}

// gemv_plain's bf16 GEMV whose owner lanes finish each output with the combine of its row's slots. An owner
// lane (lane p R + r of a row group's first warp, as gemv_rows hands out outputs) reads its row's weighted slots
// before the K loop, not after it: the routed outputs are the previous launch's (pdl_enter has waited for them),
// so their reads overlap the weight stream instead of trailing it as top_k dependent round trips. The adds keep
// the combine's order (slots in order, each product rounded before its add).
template <int R>
__device__ __forceinline__ void gemv_combine(const bf16_t* x, long long x_row_stride, const bf16_t* w,
                                             const bf16_t* routed, const float* wts, bf16_t* out, int N, int K,
                                             int ksplit, int top_k) {
    constexpr int P = GEMV_ROWS_PER_WARP;
    const Slice s = slice_of(K, ksplit, blockIdx.x);
    const int lane = threadIdx.x & 31, r = lane % R, n = s.group * P + lane / R;
    const bool owner = lane < P * R && n < N && (threadIdx.x >> 5) % ksplit == 0;
    float term[ROUTER_MAX_TOP_K];  // wts[r, k] * routed[r, k, n], rounded (top_k <= ROUTER_MAX_TOP_K: dense.py)
#pragma unroll
    for (int k = 0; k < ROUTER_MAX_TOP_K; ++k)
        term[k] = owner && k < top_k
                      ? __fmul_rn(wts[r * top_k + k], bf16_to_f32(routed[(size_t)(r * top_k + k) * N + n]))
                      : 0.0f;
    gemv_rows<R, bf16_t>(x, x_row_stride, w, N, K, ksplit, blockIdx.x, [&](int, int, float v) {
        float a = 0.0f;  // this lane's (r, n): the owner of an output is the lane that read its terms
#pragma unroll
        for (int k = 0; k < ROUTER_MAX_TOP_K; ++k)
            if (k < top_k) a = __fadd_rn(a, term[k]);
        out[(size_t)r * N + n] = f32_to_bf16(__fadd_rn(a, round_bf16(v)));
    });
}

// The router GEMV, then the top-k of every row in the block that finishes last. Counting blocks on
// ``done`` after a fence publishes this block's logits (the pattern of the CUDA samples'
// threadFenceReduction); the last block resets ``done`` so the next launch (or graph replay) starts
// from zero. ``block`` / ``nblocks``: this block's index among the router's blocks, and their count.
template <int R, typename WT>
__device__ __forceinline__ void router_gemv_topk(const bf16_t* x, long long x_row_stride, const WT* w, float* logits,
                                                 int N, int K, int ksplit, const float* bias, int* ids, float* wts,
                                                 const TopkParams& p, unsigned* done, int block, int nblocks) {
    static_assert(R <= GEMV_WARPS, "one warp per row for the top-k");
    __shared__ int chosen[R][ROUTER_MAX_TOP_K];
    __shared__ bool last;
    gemv_plain<R, WT, float>(x, x_row_stride, w, logits, N, N, K, ksplit, block);
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(done, 1u) == (unsigned)nblocks - 1;
    __syncthreads();
    if (!last) return;
    const int warp = threadIdx.x >> 5;
    if (warp < R) {
        unsigned* key = (unsigned*)dyn_smem + 2 * warp * N;
        topk_row(logits + (long long)warp * N, bias, ids + warp * p.K, wts + warp * p.K, p, key,
                 (float*)(key + N), chosen[warp]);
    }
    if (threadIdx.x == 0) *done = 0u;
}

// The router (GEMV + top-k) and a bf16 MLP's gate + up + SwiGLU on the same x in ONE launch: blocks
// [0, router_blocks) are router_gemv_topk's, the rest gemv_glu's. Both only read x, so nothing
// orders them; the router's blocks come first, so its last block's top-k overlaps the GLU's
// streaming. Every output is computed exactly as by the two separate launches.
template <int R, typename WT>
__device__ __forceinline__ void router_topk_glu(const bf16_t* x, long long x_row_stride, const WT* w, float* logits,
                                                int E, int K, int ksplit, int router_blocks, const float* bias,
                                                int* ids, float* wts, const TopkParams& p, unsigned* done,
                                                const bf16_t* wg, const bf16_t* wu, bf16_t* gate, bf16_t* up,
                                                bf16_t* act, int N, int glu_ksplit, float limit) {
    if ((int)blockIdx.x < router_blocks)
        router_gemv_topk<R, WT>(x, x_row_stride, w, logits, E, K, ksplit, bias, ids, wts, p, done, blockIdx.x,
                                router_blocks);
    else
        gemv_glu<R>(x, x_row_stride, wg, wu, gate, up, act, N, N, K, glu_ksplit, limit,
                    (int)blockIdx.x - router_blocks);
}

// The fused router entries of R rows for one router weight type WT (tag TAG: bf16w / f32w).
#define ROUTER_ENTRIES(R, TAG, WT)                                                                           \
    extern "C" __global__ void __launch_bounds__(GEMV_THREADS) router_topk_##TAG##_r##R(                     \
        const bf16_t* __restrict__ x, long long x_row_stride, const WT* __restrict__ w, float* logits, int N,   \
        int K, int ksplit, const float* __restrict__ bias, int* __restrict__ ids, float* __restrict__ wts,     \
        int top_k, float routed_scale, int renormalize, int bf16_ladder, unsigned* done) {                   \
        pdl_enter();                                                                                         \
        router_gemv_topk<R, WT>(x, x_row_stride, w, logits, N, K, ksplit, bias, ids, wts,                     \
                                TopkParams{N, top_k, routed_scale, renormalize, bf16_ladder}, done, blockIdx.x, \
                                gridDim.x);                                                                  \
    }                                                                                                        \
    extern "C" __global__ void __launch_bounds__(GEMV_THREADS) router_topk_glu_##TAG##_r##R(                 \
        const bf16_t* __restrict__ x, long long x_row_stride, const WT* __restrict__ w, float* logits, int E,   \
        int K, int ksplit, int router_blocks, const float* __restrict__ bias, int* __restrict__ ids,           \
        float* __restrict__ wts, int top_k, float routed_scale, int renormalize, int bf16_ladder,             \
        unsigned* done, const bf16_t* __restrict__ wg, const bf16_t* __restrict__ wu, bf16_t* __restrict__ gate, \
        bf16_t* __restrict__ up, bf16_t* __restrict__ act, int N, int glu_ksplit, float limit) {             \
        pdl_enter();                                                                                         \
        router_topk_glu<R, WT>(x, x_row_stride, w, logits, E, K, ksplit, router_blocks, bias, ids, wts,        \
                               TopkParams{E, top_k, routed_scale, renormalize, bf16_ladder}, done, wg, wu, gate, \
                               up, act, N, glu_ksplit, limit);                                               \
    }

#define GEMV_ENTRIES(R)                                                                                      \
    extern "C" __global__ void __launch_bounds__(GEMV_THREADS) bf16_gemv_r##R(                              \
        const bf16_t* __restrict__ x, long long x_row_stride, const bf16_t* __restrict__ w,                  \
        bf16_t* __restrict__ out, long long out_row_stride, int N, int K, int ksplit) {                      \
        pdl_enter();                                                                                         \
        gemv_plain<R, bf16_t, bf16_t>(x, x_row_stride, w, out, out_row_stride, N, K, ksplit, blockIdx.x);    \
    }                                                                                                        \
    extern "C" __global__ void __launch_bounds__(GEMV_THREADS) bf16_glu_r##R(                               \
        const bf16_t* __restrict__ x, long long x_row_stride, const bf16_t* __restrict__ wg,                 \
        const bf16_t* __restrict__ wu, bf16_t* __restrict__ gate, bf16_t* __restrict__ up,                   \
        bf16_t* __restrict__ act, long long out_row_stride, int N, int K, int ksplit, float limit) {         \
        pdl_enter();                                                                                         \
        gemv_glu<R>(x, x_row_stride, wg, wu, gate, up, act, out_row_stride, N, K, ksplit, limit, blockIdx.x); \
    }                                                                                                        \
    extern "C" __global__ void __launch_bounds__(GEMV_THREADS) bf16_gemv_combine_r##R(                      \
        const bf16_t* __restrict__ x, long long x_row_stride, const bf16_t* __restrict__ w,                  \
        const bf16_t* __restrict__ routed, const float* __restrict__ wts, bf16_t* __restrict__ out, int N,    \
        int K, int ksplit, int top_k) {                                                                      \
        pdl_enter();                                                                                         \
        gemv_combine<R>(x, x_row_stride, w, routed, wts, out, N, K, ksplit, top_k);                          \
    }                                                                                                        \
    extern "C" __global__ void __launch_bounds__(GEMV_THREADS) router_gemv_bf16w_r##R(                      \
        const bf16_t* __restrict__ x, long long x_row_stride, const bf16_t* __restrict__ w,                  \
        float* __restrict__ out, long long out_row_stride, int N, int K, int ksplit) {                       \
        pdl_enter();                                                                                         \
        gemv_plain<R, bf16_t, float>(x, x_row_stride, w, out, out_row_stride, N, K, ksplit, blockIdx.x);     \
    }                                                                                                        \
    extern "C" __global__ void __launch_bounds__(GEMV_THREADS) router_gemv_f32w_r##R(                       \
        const bf16_t* __restrict__ x, long long x_row_stride, const float* __restrict__ w,                   \
        float* __restrict__ out, long long out_row_stride, int N, int K, int ksplit) {                       \
        pdl_enter();                                                                                         \
        gemv_plain<R, float, float>(x, x_row_stride, w, out, out_row_stride, N, K, ksplit, blockIdx.x);      \
    }                                                                                                        \
    ROUTER_ENTRIES(R, bf16w, bf16_t)                                                                         \
    ROUTER_ENTRIES(R, f32w, float)

GEMV_ENTRIES(1)
GEMV_ENTRIES(2)
GEMV_ENTRIES(3)
GEMV_ENTRIES(4)
GEMV_ENTRIES(5)
GEMV_ENTRIES(6)
GEMV_ENTRIES(7)
GEMV_ENTRIES(8)
