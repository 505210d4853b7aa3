// bf16 x bf16 tensor-core GEMM for the rows between the GEMV tiers and cuBLAS (9..64 rows): a wide
// prefill's dense FFN, shared expert and router read every weight ONCE for all rows, at the byte
// rate, where a generic GEMM under-fills the machine with 16..64-row tiles.
//   out[r, n] = sum_k x[r, k] * w[n, k], fp32 accumulation, bf16 (or fp32: router logits) out.
//
// mma.sync m16n8k16, A = 16 weight rows, B = up to 8 NT x rows (8 per n8 tile; rows past R are zero).
// The k order inside one mma is free as long as A and B agree lane by lane: lane (g, t) of a 32-k
// step loads the 8 consecutive k 8t .. 8t + 7 of weight rows n0 + g and n0 + g + 8 (16 bytes each,
// streamed) and of x row 8j + g for each n8 tile j (16 bytes, cached), and feeds pairs (8t, 8t + 1),
// (8t + 2, 8t + 3) to one mma and the other two pairs to a second.
//
// Work split: a block is MMA_GEMM_WARPS warps; `ksplit` consecutive warps share a group of 16
// weight rows (of one matrix, or of gate AND up), each sweeping a contiguous slice of K; the slices
// meet in shared memory and are added in slice order (deterministic). K must be a multiple of 32.
//
// Entry points, T = 8 NT rows at most (grids computed in glm_ep/backend/cuda/dense.py):
//   bf16_mma_gemm_t{T}         bf16 out (the backend's `linear`)
//   bf16_mma_gemm_f32_t{T}     fp32 out (router logits of a bf16 router)
//   bf16_mma_glu_t{T}          gate and up fused, writing gate, up and the clamped SwiGLU
#include "common.cuh"
#include "async_copy.cuh"
#include "nvfp4_mma.cuh"

#ifndef MMA_GEMM_WARPS
#error "MMA_GEMM_WARPS is set by glm_ep/backend/cuda/loader.py"
#endif
#define MMA_GEMM_THREADS (MMA_GEMM_WARPS * 32)

__device__ __forceinline__ void store_out(bf16_t* p, float v) { *p = f32_to_bf16(v); }
__device__ __forceinline__ void store_out(float* p, float v) { *p = v; }

// One warp: P matrices' 16 rows (w[p][0]: row n0 + g, w[p][1]: row n0 + g + 8; nullptr: zeros) over
// the 32-k steps [s_lo, s_hi), x rows through xr[j] (row 8j + g, nullptr: zeros). acc[p][j]: rows
// (n0 + g, n0 + g + 8) x (x rows 8j + 2t, 8j + 2t + 1).
template <int P, int NT>
__device__ __forceinline__ void mma_rows(const bf16_t* const (&w)[P][2], const bf16_t* const (&xr)[NT], int s_lo,
                                         int s_hi, float (&acc)[P][NT][4]) {
    const int t = threadIdx.x & 3;
#pragma unroll
    for (int p = 0; p < P; ++p)
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int c = 0; c < 4; ++c) acc[p][j][c] = 0.0f;
    const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
    uint4 wv[P][2], wn[P][2];
    auto load_w = [&](int s, uint4(&v)[P][2]) {
#pragma unroll
        for (int p = 0; p < P; ++p)
#pragma unroll
            for (int h = 0; h < 2; ++h)
                v[p][h] = (s < s_hi && w[p][h]) ? ld_stream_v4(w[p][h] + 32 * (size_t)s + 8 * t) : zero;
    };
    load_w(s_lo, wv);
    for (int s = s_lo; s < s_hi; ++s) {
        load_w(s + 1, wn);  // the next step's weights in flight during this step's math
#pragma unroll
        for (int j = 0; j < NT; ++j) {
            const uint4 xv = xr[j] ? ld_cached_v4(xr[j] + 32 * (size_t)s + 8 * t) : zero;
#pragma unroll
            for (int p = 0; p < P; ++p) {
                mma_bf16(acc[p][j], wv[p][0].x, wv[p][1].x, wv[p][0].y, wv[p][1].y, xv.x, xv.y);
                mma_bf16(acc[p][j], wv[p][0].z, wv[p][1].z, wv[p][0].w, wv[p][1].w, xv.z, xv.w);
            }
        }
#pragma unroll
        for (int p = 0; p < P; ++p)
#pragma unroll
            for (int h = 0; h < 2; ++h) wv[p][h] = wn[p][h];
    }
}

// The row group's K slices added in slice order (dynamic shared memory: one slot per warp and lane);
// true in the warp that then holds the totals.
template <int P, int NT>
__device__ __forceinline__ bool slices_add(float (&acc)[P][NT][4], int ksplit) {
    if (ksplit == 1) return true;
    float* red = reinterpret_cast<float*>(dyn_smem);  // [warps][P * NT * 4][32]
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    constexpr int V = P * NT * 4;
#pragma unroll
    for (int p = 0; p < P; ++p)
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int c = 0; c < 4; ++c) red[(warp * V + (p * NT + j) * 4 + c) * 32 + lane] = acc[p][j][c];
    __syncthreads();
    if (warp % ksplit) return false;
    for (int q = 1; q < ksplit; ++q)
#pragma unroll
        for (int p = 0; p < P; ++p)
#pragma unroll
            for (int j = 0; j < NT; ++j)
#pragma unroll
                for (int c = 0; c < 4; ++c) acc[p][j][c] += red[((warp + q) * V + (p * NT + j) * 4 + c) * 32 + lane];
    return true;
}

struct RowGroup {
    int n0, s_lo, s_hi;
};

__device__ __forceinline__ RowGroup row_group(int K, int ksplit) {
    const int warp = threadIdx.x >> 5, ks = warp % ksplit;
    const int steps = K >> 5, per = (steps + ksplit - 1) / ksplit, lo = min(steps, ks * per);
    return RowGroup{((int)blockIdx.x * (MMA_GEMM_WARPS / ksplit) + warp / ksplit) * 16, lo, min(steps, lo + per)};
}

// The lane's x rows 8j + g (nullptr past R) and weight rows n0 + g, n0 + g + 8 (nullptr past N).
template <int NT>
__device__ __forceinline__ void lane_x(const bf16_t* x, long long x_row_stride, int R, const bf16_t* (&xr)[NT]) {
    const int g = (threadIdx.x & 31) >> 2;
#pragma unroll
    for (int j = 0; j < NT; ++j) xr[j] = 8 * j + g < R ? x + (8 * j + g) * x_row_stride : nullptr;
}

__device__ __forceinline__ void lane_w(const bf16_t* w, int n0, int N, int K, const bf16_t* (&wr)[2]) {
    const int n = n0 + ((threadIdx.x & 31) >> 2);
    wr[0] = n < N ? w + (size_t)n * K : nullptr;
    wr[1] = n + 8 < N ? w + (size_t)(n + 8) * K : nullptr;
}

template <int NT, typename OT>
__device__ __forceinline__ void mma_gemm(const bf16_t* __restrict__ x, long long x_row_stride,
                                         const bf16_t* __restrict__ w, OT* __restrict__ out, long long out_row_stride,
                                         int R, int N, int K, int ksplit) {
    const RowGroup grp = row_group(K, ksplit);
    const bf16_t* xr[NT];
    const bf16_t* wr[1][2];
    lane_x<NT>(x, x_row_stride, R, xr);
    lane_w(w, grp.n0, N, K, wr[0]);
    float acc[1][NT][4];
    mma_rows<1, NT>(wr, xr, grp.s_lo, grp.s_hi, acc);
    if (!slices_add<1, NT>(acc, ksplit)) return;
    const int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            const int r = 8 * j + 2 * t + (c & 1), n = grp.n0 + g + 8 * (c >> 1);
            if (r < R && n < N) store_out(out + r * out_row_stride + n, acc[0][j][c]);
        }
}

template <int NT>
__device__ __forceinline__ void mma_glu(const bf16_t* __restrict__ x, long long x_row_stride,
                                        const bf16_t* __restrict__ wg, const bf16_t* __restrict__ wu,
                                        bf16_t* __restrict__ gate, bf16_t* __restrict__ up, bf16_t* __restrict__ act,
                                        long long out_row_stride, int R, int N, int K, int ksplit, float limit) {
    const RowGroup grp = row_group(K, ksplit);
    const bf16_t* xr[NT];
    const bf16_t* wr[2][2];
    lane_x<NT>(x, x_row_stride, R, xr);
    lane_w(wg, grp.n0, N, K, wr[0]);
    lane_w(wu, grp.n0, N, K, wr[1]);
    float acc[2][NT][4];
    mma_rows<2, NT>(wr, xr, grp.s_lo, grp.s_hi, acc);
    if (!slices_add<2, NT>(acc, ksplit)) return;
    const int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            const int r = 8 * j + 2 * t + (c & 1), n = grp.n0 + g + 8 * (c >> 1);
            if (r < R && n < N) {
                const long long o = r * out_row_stride;
                glu_store(gate + o, up + o, act + o, n, acc[0][j][c], acc[1][j][c], limit);
            }
        }
}

#define MMA_GEMM_ENTRIES(T)                                                                                      \
    extern "C" __global__ void __launch_bounds__(MMA_GEMM_THREADS)                                              \
        bf16_mma_gemm_t##T(const bf16_t* x, long long x_row_stride, const bf16_t* w, bf16_t* out,                \
                           long long out_row_stride, int R, int N, int K, int ksplit) {                          \
        pdl_enter();                                                                                             \
        mma_gemm<T / 8, bf16_t>(x, x_row_stride, w, out, out_row_stride, R, N, K, ksplit);                       \
    }                                                                                                            \
    extern "C" __global__ void __launch_bounds__(MMA_GEMM_THREADS)                                              \
        bf16_mma_gemm_f32_t##T(const bf16_t* x, long long x_row_stride, const bf16_t* w, float* out,             \
                               long long out_row_stride, int R, int N, int K, int ksplit) {                      \
        pdl_enter();                                                                                             \
        mma_gemm<T / 8, float>(x, x_row_stride, w, out, out_row_stride, R, N, K, ksplit);                        \
    }                                                                                                            \
    extern "C" __global__ void __launch_bounds__(MMA_GEMM_THREADS)                                              \
        bf16_mma_glu_t##T(const bf16_t* x, long long x_row_stride, const bf16_t* wg, const bf16_t* wu,           \
                          bf16_t* gate, bf16_t* up, bf16_t* act, long long out_row_stride, int R, int N, int K,  \
                          int ksplit, float limit) {                                                             \
        pdl_enter();                                                                                             \
        mma_glu<T / 8>(x, x_row_stride, wg, wu, gate, up, act, out_row_stride, R, N, K, ksplit, limit);          \
    }

MMA_GEMM_ENTRIES(16)
MMA_GEMM_ENTRIES(32)
MMA_GEMM_ENTRIES(64)

// ---- the streaming engine: weights of a dense FFN's size (9..64 rows) -------------------------------
// The GEMM above re-reads the x rows in every warp and keeps one step of weights in flight; on a
// [12288, 4096] weight that streams well below cuBLAS. Here a block of W warps works on ONE K slice,
// fed by a ring of `slots` stages in shared memory (cp.async, `slots` - 1 stages in flight: the bytes in
// flight do not cost registers). A stage is KS k of the block's 32 W weight rows and of the x rows, a
// line of 2 KS bytes of each row, copied by KS / 8 threads a row.
//   Tiles of a warp: plain, 32 consecutive weight rows (32 W a block); glu, 16 gate and the same 16 up
//   rows (16 W outputs a block, the SwiGLU in the epilogue). Stage row 32 w + q holds warp w's row q.
//   K slices: block b is row block b / S, slice b % S, a slice a whole number of stages. With S > 1
//   every block writes its fp32 partial sums to `partials` ([grid][2 NT 4][threads]), and the block of
//   a row block that arrives last (`arrived[row block]`, which it resets to 0 for the next launch) adds
//   the S slices in slice order, so the result does not depend on which block came last.
//   Row r's 16-byte chunk c sits at chunk c ^ 4 (r & 1) of its line: the two rows an 8-lane phase of
//   the fragment loads reads (g = 2q, 2q + 1, chunks 4i .. 4i + 3) fall on all 32 banks.
template <int W, int KS>
struct StreamShape {
    static_assert(KS % 32 == 0 && (KS / 8) <= 32 * W, "a stage is whole steps of 32 k");
    static constexpr int THREADS = 32 * W, ROWS = 32 * W, LINE = 2 * KS, CP = KS / 8, RPP = THREADS / CP,
                         W_BYTES = ROWS * LINE, STEPS = KS / 32;
};

struct StreamSlice {
    int rb, s_lo, s_hi;  // row block; the slice's 32-k steps [s_lo, s_hi)
};

template <int STEPS>
__device__ __forceinline__ StreamSlice stream_slice(int K, int S) {
    const int steps = K >> 5, per = (steps + STEPS * S - 1) / (STEPS * S) * STEPS;
    const int s = (int)blockIdx.x % S, lo = min(steps, s * per);
    return StreamSlice{(int)blockIdx.x / S, lo, min(steps, lo + per)};
}

__device__ __forceinline__ unsigned stream_chunk(int r, int c, int line) {
    return (unsigned)(r * line + 16 * (c ^ ((r & 1) << 2)));
}

// cp.async.wait_group takes an immediate: the ring's depth is a launch argument.
__device__ __forceinline__ void cp_async_wait_upto(int n) {
    switch (n) {
        case 0: cp_async_wait<0>(); break;
        case 1: cp_async_wait<1>(); break;
        case 2: cp_async_wait<2>(); break;
        case 3: cp_async_wait<3>(); break;
        case 4: cp_async_wait<4>(); break;
        case 5: cp_async_wait<5>(); break;
        default: cp_async_wait<6>(); break;
    }
}

// The weight rows a block streams: plain, rows base .. base + 32 W of w0; glu, stage row 32 w + q is row
// base + 16 w + q % 16 of w0 (gate, q < 16) or w1 (up). Rows at or past N read as zeros.
struct StreamCopy {
    const bf16_t* w0;
    const bf16_t* w1;
    int base, N;
    bool glu;
};

// acc[m][j]: warp tile m's rows (g, g + 8) x (x rows 8j + 2t, 8j + 2t + 1), over the slice's steps.
template <int NT, int W, int KS>
__device__ __forceinline__ void stream_rows(const bf16_t* __restrict__ x, long long x_row_stride, int R,
                                            const StreamCopy& cp, int K, int s_lo, int s_hi, int slots,
                                            float (&acc)[2][NT][4]) {
    using SH = StreamShape<W, KS>;
    constexpr int T = 8 * NT, STAGE = SH::W_BYTES + T * SH::LINE;
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3, warp = threadIdx.x >> 5;
    const int c = threadIdx.x % SH::CP, r0 = threadIdx.x / SH::CP;
    const unsigned ring = smem_u32(dyn_smem);
    const int stages = (s_hi - s_lo + SH::STEPS - 1) / SH::STEPS;
#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[m][j][e] = 0.0f;
    auto load = [&](int st) {
        if (st < stages) {
            const unsigned slot = ring + (unsigned)((st % slots) * STAGE);
            const int k0 = (s_lo + SH::STEPS * st) * 32, k_end = s_hi * 32, k = k0 + 8 * c;
#pragma unroll
            for (int p = 0; p < SH::CP; ++p) {
                const int sr = p * SH::RPP + r0, q = sr & 31;
                const int n = cp.glu ? cp.base + 16 * (sr >> 5) + (q & 15) : cp.base + sr;
                const bf16_t* w = cp.glu && q >= 16 ? cp.w1 : cp.w0;
                const bool valid = k < k_end && n < cp.N;
                cp_async16_zfill(slot + stream_chunk(sr, c, SH::LINE), valid ? w + (size_t)n * K + k : w, valid);
            }
            for (int i = threadIdx.x; i < T * SH::CP; i += SH::THREADS) {
                const int r = i / SH::CP, cx = i % SH::CP, kx = k0 + 8 * cx;
                const bool valid = r < R && kx < k_end;
                cp_async16_zfill(slot + SH::W_BYTES + stream_chunk(r, cx, SH::LINE),
                                 valid ? x + r * x_row_stride + kx : x, valid);
            }
        }
        cp_async_commit();  // empty groups keep the wait count uniform
    };
    for (int st = 0; st < slots - 1; ++st) load(st);
    for (int st = 0; st < stages; ++st) {
        cp_async_wait_upto(slots - 2);
        __syncthreads();  // stage st landed for every thread; every warp is done with the slot reloaded next
        load(st + slots - 1);
        const unsigned slot = ring + (unsigned)((st % slots) * STAGE);
#pragma unroll
        for (int i = 0; i < SH::STEPS; ++i) {
            if (s_lo + SH::STEPS * st + i >= s_hi) break;  // the slice's last stage may be short (uniform)
            uint4 a[2][2];
#pragma unroll
            for (int m = 0; m < 2; ++m)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int r = 32 * warp + 16 * m + 8 * h + g;
                    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                                 : "=r"(a[m][h].x), "=r"(a[m][h].y), "=r"(a[m][h].z), "=r"(a[m][h].w)
                                 : "r"(slot + stream_chunk(r, 4 * i + t, SH::LINE)));
                }
#pragma unroll
            for (int j = 0; j < NT; ++j) {
                uint4 b;
                asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                             : "=r"(b.x), "=r"(b.y), "=r"(b.z), "=r"(b.w)
                             : "r"(slot + SH::W_BYTES + stream_chunk(8 * j + g, 4 * i + t, SH::LINE)));
#pragma unroll
                for (int m = 0; m < 2; ++m) {
                    mma_bf16(acc[m][j], a[m][0].x, a[m][1].x, a[m][0].y, a[m][1].y, b.x, b.y);
                    mma_bf16(acc[m][j], a[m][0].z, a[m][1].z, a[m][0].w, a[m][1].w, b.z, b.w);
                }
            }
        }
    }
    cp_async_wait<0>();
}

// The K slices of a row block added in slice order (S > 1); true in the block that then holds the totals.
template <int NT, int THREADS>
__device__ __forceinline__ bool stream_slices_add(float (&acc)[2][NT][4], int S, float* __restrict__ partials,
                                                  unsigned* __restrict__ arrived) {
    if (S == 1) return true;
    __shared__ bool last;
    constexpr int V = 2 * NT * 4;
    const int rb = (int)blockIdx.x / S, s = (int)blockIdx.x % S;
    float* mine = partials + (size_t)blockIdx.x * V * THREADS + threadIdx.x;
#pragma unroll
    for (int v = 0; v < V; ++v) __stcg(mine + v * THREADS, acc[v / (NT * 4)][(v / 4) % NT][v % 4]);
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(arrived + rb, 1u) == (unsigned)S - 1;
    __syncthreads();
    if (!last) return false;
    __threadfence();
    const float* first = partials + (size_t)rb * S * V * THREADS + threadIdx.x;
#pragma unroll
    for (int v = 0; v < V; ++v) {
        float& own = acc[v / (NT * 4)][(v / 4) % NT][v % 4];
        float a = s == 0 ? own : __ldcg(first + v * THREADS);
        for (int q = 1; q < S; ++q) a += q == s ? own : __ldcg(first + ((size_t)q * V + v) * THREADS);
        own = a;
    }
    if (threadIdx.x == 0) arrived[rb] = 0u;
    return true;
}

template <int NT, int W, int KS, typename OT>
__device__ __forceinline__ void stream_gemm(const bf16_t* __restrict__ x, long long x_row_stride,
                                            const bf16_t* __restrict__ w, OT* __restrict__ out,
                                            long long out_row_stride, int R, int N, int K, int S, int slots,
                                            float* __restrict__ partials, unsigned* __restrict__ arrived) {
    const StreamSlice sl = stream_slice<KS / 32>(K, S);
    const int base = sl.rb * W * 32;
    float acc[2][NT][4];
    stream_rows<NT, W, KS>(x, x_row_stride, R, StreamCopy{w, w, base, N, false}, K, sl.s_lo, sl.s_hi, slots, acc);
    if (!stream_slices_add<NT, 32 * W>(acc, S, partials, arrived)) return;
    const int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3, n0 = base + (threadIdx.x >> 5) * 32;
#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                const int r = 8 * j + 2 * t + (c & 1), n = n0 + 16 * m + g + 8 * (c >> 1);
                if (r < R && n < N) store_out(out + r * out_row_stride + n, acc[m][j][c]);
            }
}

template <int NT, int W, int KS>
__device__ __forceinline__ void stream_glu(const bf16_t* __restrict__ x, long long x_row_stride,
                                           const bf16_t* __restrict__ wg, const bf16_t* __restrict__ wu,
                                           bf16_t* __restrict__ gate, bf16_t* __restrict__ up,
                                           bf16_t* __restrict__ act, long long out_row_stride, int R, int N, int K,
                                           int S, int slots, float limit, float* __restrict__ partials,
                                           unsigned* __restrict__ arrived) {
    const StreamSlice sl = stream_slice<KS / 32>(K, S);
    const int base = sl.rb * W * 16;
    float acc[2][NT][4];
    stream_rows<NT, W, KS>(x, x_row_stride, R, StreamCopy{wg, wu, base, N, true}, K, sl.s_lo, sl.s_hi, slots, acc);
    if (!stream_slices_add<NT, 32 * W>(acc, S, partials, arrived)) return;
    const int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3, n0 = base + (threadIdx.x >> 5) * 16;
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            const int r = 8 * j + 2 * t + (c & 1), n = n0 + g + 8 * (c >> 1);
            if (r < R && n < N) {
                const long long o = r * out_row_stride;
                glu_store(gate + o, up + o, act + o, n, acc[0][j][c], acc[1][j][c], limit);
            }
        }
}

// Entry points bf16_stream_{gemm, gemm_f32, glu}_t{T}_w{W}k{KS}: T rows at most, W warps, KS k a stage.
#define STREAM_ENTRIES(T, W, KS)                                                                                 \
    extern "C" __global__ void __launch_bounds__(32 * W, 1) bf16_stream_gemm_t##T##_w##W##k##KS(                 \
        const bf16_t* x, long long x_row_stride, const bf16_t* w, bf16_t* out, long long out_row_stride, int R,   \
        int N, int K, int S, int slots, float* partials, unsigned* arrived) {                                    \
        pdl_enter();                                                                                             \
        stream_gemm<T / 8, W, KS, bf16_t>(x, x_row_stride, w, out, out_row_stride, R, N, K, S, slots, partials,  \
                                          arrived);                                                              \
    }                                                                                                            \
    extern "C" __global__ void __launch_bounds__(32 * W, 1) bf16_stream_gemm_f32_t##T##_w##W##k##KS(             \
        const bf16_t* x, long long x_row_stride, const bf16_t* w, float* out, long long out_row_stride, int R,    \
        int N, int K, int S, int slots, float* partials, unsigned* arrived) {                                    \
        pdl_enter();                                                                                             \
        stream_gemm<T / 8, W, KS, float>(x, x_row_stride, w, out, out_row_stride, R, N, K, S, slots, partials,   \
                                         arrived);                                                               \
    }                                                                                                            \
    extern "C" __global__ void __launch_bounds__(32 * W, 1) bf16_stream_glu_t##T##_w##W##k##KS(                  \
        const bf16_t* x, long long x_row_stride, const bf16_t* wg, const bf16_t* wu, bf16_t* gate, bf16_t* up,    \
        bf16_t* act, long long out_row_stride, int R, int N, int K, int S, int slots, float limit,               \
        float* partials, unsigned* arrived) {                                                                    \
        pdl_enter();                                                                                             \
        stream_glu<T / 8, W, KS>(x, x_row_stride, wg, wu, gate, up, act, out_row_stride, R, N, K, S, slots,      \
                                 limit, partials, arrived);                                                      \
    }

#define STREAM_TIER_ENTRIES(W, KS) \
    STREAM_ENTRIES(8, W, KS)       \
    STREAM_ENTRIES(16, W, KS)      \
    STREAM_ENTRIES(32, W, KS)      \
    STREAM_ENTRIES(64, W, KS)

STREAM_TIER_ENTRIES(8, 64)
STREAM_TIER_ENTRIES(4, 128)
STREAM_TIER_ENTRIES(8, 128)
STREAM_TIER_ENTRIES(4, 64)
STREAM_TIER_ENTRIES(2, 256)
STREAM_TIER_ENTRIES(4, 256)
STREAM_TIER_ENTRIES(1, 256)
STREAM_TIER_ENTRIES(1, 128)
