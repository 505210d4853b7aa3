// bf16 x bf16 warp-streaming tensor-core GEMM: the dense FFN's weights at 5..16 rows (gate + up + SwiGLU; a
// plain projection to 8) and the shared expert's at 5..8, every weight read ONCE for all rows.
//   out[r, n] = sum_k x[r, k] * w[n, k], fp32 accumulation, bf16 out.
//
// mma.sync m16n8k16, A = 16 weight rows, B = up to 8 NT x rows (8 per n8 tile; rows past R are zero).
// The k order inside one mma is free as long as A and B agree lane by lane: lane (g, t) of a 32-k
// step takes the 8 consecutive k 8t .. 8t + 7 of its warp's weight rows g and g + 8 (from the warp's ring in
// shared memory) and of x row 8j + g for each n8 tile j (16 bytes, cached), and feeds pairs (8t, 8t + 1),
// (8t + 2, 8t + 3) to one mma and the other two pairs to a second. K must be a multiple of 32.
//
// Entry points, T = 8 NT rows at most (grids computed in glm_ep/backend/cuda/dense.py):
//   bf16_wstream_gemm_t{8,16}  out = x @ w^T (the backend's `linear`)
//   bf16_wstream_glu_t{8,16}   gate and up fused, writing gate, up and the clamped SwiGLU
//
// NumPy twin: NumpyBackend.linear and gate_up_act (glm_ep/backend/numpy_backend.py); held together
// by tests/cuda/test_cuda_dense.py (every tier, K splits, graphs).
#include "common.cuh"
#include "async_copy.cuh"
#include "nvfp4_mma.cuh"

// Measured (docs/perf/DESIGN-NOTES.md): a launch streams a weight near the copy bandwidth only with many
// independent pipelines an SM (12 warps, each its own band and ring), and far below it when a block steps a
// wide band in lock step. So here every WARP streams its own 16 weight rows
// through its own ring of WSTREAM_DEPTH stages in shared memory: a stage is the rows' next 512 bytes
// (256 k), one cp.async of 16 bytes a lane a row (each instruction one row's contiguous 512 bytes); the
// warp waits only on its own copies (no block barrier in the loop). x rows come through L1 (the block's
// warps read the same k), a stage's B fragments loaded before its mma. Rows of a warp: plain, 16
// consecutive; glu, gate rows n0 .. n0 + 7 then up rows n0 .. n0 + 7 (so one lane holds gate AND up of
// its outputs: the SwiGLU in the epilogue). Blocks: WSTREAM_WARPS warps on one K slice of one row block;
// with S > 1 slices the block of a row block that arrives last adds the fp32 partials in slice order
// (wstream_slices_add: deterministic).
//   Ring slot: 16 rows of 512 bytes; chunk c of row r at chunk c ^ 4 (r & 1) (an 8-lane phase of the
//   fragment loads reads rows 2q, 2q + 1 at chunks 4i .. 4i + 3: all 32 banks).
#ifndef WSTREAM_WARPS
#error "WSTREAM_WARPS is set by glm_ep/backend/cuda/kernel_loader.py"
#endif
#ifndef WSTREAM_DEPTH
#error "WSTREAM_DEPTH is set by glm_ep/backend/cuda/kernel_loader.py"
#endif
#ifndef WSTREAM_STAGE_K
#error "WSTREAM_STAGE_K is set by glm_ep/backend/cuda/kernel_loader.py"
#endif
static_assert(WSTREAM_DEPTH == 2 || WSTREAM_DEPTH == 3, "wait counts below are written for 2 or 3 stages");
static_assert(WSTREAM_STAGE_K == 32 * 8, "a stage is one 16-byte copy (8 k) a lane a row: the loader's K slices and "
              "shared memory are sized by it");
#define WSTREAM_THREADS (WSTREAM_WARPS * 32)
#define WSTREAM_SLOT (16 * 2 * WSTREAM_STAGE_K)  // bytes of one stage of one warp

__device__ __forceinline__ unsigned wstream_chunk(int r, int c) {
    return (unsigned)(r * 512 + 16 * (c ^ ((r & 1) << 2)));
}

// One warp's 16 rows (rows[r]: row r's base, nullptr: zeros) over the 32-k steps [s_lo, s_hi); acc[j]: rows
// (g, g + 8) x (x rows 8j + 2t, 8j + 2t + 1).
template <int NT>
__device__ __forceinline__ void wstream_rows(const bf16_t* __restrict__ x, long long x_row_stride, int R,
                                             const bf16_t* const (&rows)[16], int s_lo, int s_hi,
                                             float (&acc)[NT][4]) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3, warp = threadIdx.x >> 5;
    const unsigned ring = smem_u32(dyn_smem) + (unsigned)(warp * WSTREAM_DEPTH * WSTREAM_SLOT);
    constexpr int STEPS = WSTREAM_STAGE_K / 32;
    const int stages = (s_hi - s_lo + STEPS - 1) / STEPS;
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[j][e] = 0.0f;
    auto load = [&](int st) {
        if (st < stages) {
            const unsigned slot = ring + (unsigned)((st % WSTREAM_DEPTH) * WSTREAM_SLOT);
            const int k = (s_lo + STEPS * st) * 32 + 8 * lane;
            const bool in_k = k < s_hi * 32;
#pragma unroll
            for (int r = 0; r < 16; ++r) {
                const bool valid = in_k && rows[r];
                cp_async16_zfill(slot + wstream_chunk(r, lane), valid ? rows[r] + k : x, valid);
            }
        }
        cp_async_commit();
    };
    const bf16_t* xr[NT];
#pragma unroll
    for (int j = 0; j < NT; ++j) xr[j] = 8 * j + g < R ? x + (8 * j + g) * x_row_stride : nullptr;
    const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
    for (int st = 0; st < WSTREAM_DEPTH - 1; ++st) load(st);
    for (int st = 0; st < stages; ++st) {
        uint4 xv[STEPS][NT];  // the stage's B fragments, in flight while the warp waits on its weights
#pragma unroll
        for (int i = 0; i < STEPS; ++i) {
            const int s = s_lo + STEPS * st + i;
#pragma unroll
            for (int j = 0; j < NT; ++j) xv[i][j] = (s < s_hi && xr[j]) ? ld_cached_v4(xr[j] + 32 * s + 8 * t) : zero;
        }
        if (WSTREAM_DEPTH == 2) cp_async_wait<0>(); else cp_async_wait<1>();
        __syncwarp();  // stage st landed for every lane; every lane is done with the slot reloaded next
        load(st + WSTREAM_DEPTH - 1);
        const unsigned slot = ring + (unsigned)((st % WSTREAM_DEPTH) * WSTREAM_SLOT);
#pragma unroll
        for (int i = 0; i < STEPS; ++i) {
            if (s_lo + STEPS * st + i >= s_hi) break;  // the slice's last stage may be short (uniform in the warp)
            uint4 a[2];
#pragma unroll
            for (int h = 0; h < 2; ++h)
                asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                             : "=r"(a[h].x), "=r"(a[h].y), "=r"(a[h].z), "=r"(a[h].w)
                             : "r"(slot + wstream_chunk(g + 8 * h, 4 * i + t)));
#pragma unroll
            for (int j = 0; j < NT; ++j) {
                mma_bf16(acc[j], a[0].x, a[1].x, a[0].y, a[1].y, xv[i][j].x, xv[i][j].y);
                mma_bf16(acc[j], a[0].z, a[1].z, a[0].w, a[1].w, xv[i][j].z, xv[i][j].w);
            }
        }
    }
    cp_async_wait<0>();
}

// The K slices of a row block added in slice order (S > 1); true in the block that then holds the totals.
template <int NT>
__device__ __forceinline__ bool wstream_slices_add(float (&acc)[NT][4], int S, float* __restrict__ partials,
                                                   unsigned* __restrict__ arrived) {
    if (S == 1) return true;
    __shared__ bool last;
    constexpr int V = NT * 4;
    const int rb = (int)blockIdx.x / S, s = (int)blockIdx.x % S;
    float* mine = partials + (size_t)blockIdx.x * V * WSTREAM_THREADS + threadIdx.x;
#pragma unroll
    for (int v = 0; v < V; ++v) __stcg(mine + v * WSTREAM_THREADS, acc[v / 4][v % 4]);
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(arrived + rb, 1u) == (unsigned)S - 1;
    __syncthreads();
    if (!last) return false;
    __threadfence();
    const float* first = partials + (size_t)rb * S * V * WSTREAM_THREADS + threadIdx.x;
#pragma unroll
    for (int v = 0; v < V; ++v) {
        float& own = acc[v / 4][v % 4];
        float a = s == 0 ? own : __ldcg(first + v * WSTREAM_THREADS);
        for (int q = 1; q < S; ++q) a += q == s ? own : __ldcg(first + ((size_t)q * V + v) * WSTREAM_THREADS);
        own = a;
    }
    if (threadIdx.x == 0) arrived[rb] = 0u;
    return true;
}

// Block b: row block b / S, K slice b % S (slices of whole stages, the last one short).
__device__ __forceinline__ int2 wstream_slice(int K, int S) {
    constexpr int STEPS = WSTREAM_STAGE_K / 32;
    const int steps = K >> 5, per = (steps + STEPS * S - 1) / (STEPS * S) * STEPS;
    const int lo = min(steps, ((int)blockIdx.x % S) * per);
    return make_int2(lo, min(steps, lo + per));
}

template <int NT>
__device__ __forceinline__ void wstream_gemm(const bf16_t* __restrict__ x, long long x_row_stride,
                                             const bf16_t* __restrict__ w, bf16_t* __restrict__ out,
                                             long long out_row_stride, int R, int N, int K, int S,
                                             float* __restrict__ partials, unsigned* __restrict__ arrived) {
    const int2 sl = wstream_slice(K, S);
    const int n0 = ((int)blockIdx.x / S) * WSTREAM_WARPS * 16 + (threadIdx.x >> 5) * 16;
    const bf16_t* rows[16];
#pragma unroll
    for (int r = 0; r < 16; ++r) rows[r] = n0 + r < N ? w + (size_t)(n0 + r) * K : nullptr;
    float acc[NT][4];
    wstream_rows<NT>(x, x_row_stride, R, rows, sl.x, sl.y, acc);
    if (!wstream_slices_add<NT>(acc, S, partials, arrived)) return;
    const int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            const int r = 8 * j + 2 * t + (c & 1), n = n0 + g + 8 * (c >> 1);
            if (r < R && n < N) out[r * out_row_stride + n] = f32_to_bf16(acc[j][c]);
        }
}

template <int NT>
__device__ __forceinline__ void wstream_glu(const bf16_t* __restrict__ x, long long x_row_stride,
                                            const bf16_t* __restrict__ wg, const bf16_t* __restrict__ wu,
                                            bf16_t* __restrict__ gate, bf16_t* __restrict__ up,
                                            bf16_t* __restrict__ act, long long out_row_stride, int R, int N, int K,
                                            int S, float limit, float* __restrict__ partials,
                                            unsigned* __restrict__ arrived) {
    const int2 sl = wstream_slice(K, S);
    const int n0 = ((int)blockIdx.x / S) * WSTREAM_WARPS * 8 + (threadIdx.x >> 5) * 8;
    const bf16_t* rows[16];  // gate rows n0 .. n0 + 7, then up rows n0 .. n0 + 7
#pragma unroll
    for (int r = 0; r < 16; ++r) rows[r] = n0 + (r & 7) < N ? (r < 8 ? wg : wu) + (size_t)(n0 + (r & 7)) * K : nullptr;
    float acc[NT][4];
    wstream_rows<NT>(x, x_row_stride, R, rows, sl.x, sl.y, acc);
    if (!wstream_slices_add<NT>(acc, S, partials, arrived)) return;
    const int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3, n = n0 + g;
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int c = 0; c < 2; ++c) {
            const int r = 8 * j + 2 * t + c;
            if (r < R && n < N) {
                const long long o = r * out_row_stride;
                glu_store(gate + o, up + o, act + o, n, acc[j][c], acc[j][c + 2], limit);
            }
        }
}

#define WSTREAM_ENTRIES(T)                                                                                       \
    extern "C" __global__ void __launch_bounds__(WSTREAM_THREADS) bf16_wstream_gemm_t##T(                         \
        const bf16_t* x, long long x_row_stride, const bf16_t* w, bf16_t* out, long long out_row_stride, int R,   \
        int N, int K, int S, float* partials, unsigned* arrived) {                                               \
        pdl_enter();                                                                                             \
        wstream_gemm<T / 8>(x, x_row_stride, w, out, out_row_stride, R, N, K, S, partials, arrived);             \
    }                                                                                                            \
    extern "C" __global__ void __launch_bounds__(WSTREAM_THREADS) bf16_wstream_glu_t##T(                          \
        const bf16_t* x, long long x_row_stride, const bf16_t* wg, const bf16_t* wu, bf16_t* gate, bf16_t* up,    \
        bf16_t* act, long long out_row_stride, int R, int N, int K, int S, float limit, float* partials,         \
        unsigned* arrived) {                                                                                     \
        pdl_enter();                                                                                             \
        wstream_glu<T / 8>(x, x_row_stride, wg, wu, gate, up, act, out_row_stride, R, N, K, S, limit, partials,  \
                           arrived);                                                                             \
    }

WSTREAM_ENTRIES(8)
WSTREAM_ENTRIES(16)
