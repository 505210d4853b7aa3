// NVFP4 (W4A16) GEMV on the tensor cores, for 1..8 rows of x at once:
//   out[r, n] = bf16(sum_k x[r, k] * w[n, k]),  w[n, k] = e2m1 * e4m3(scale[n, k / 16]) * scale_2
// through mma.sync m16n8k16 (bf16 operands, fp32 accumulators): sixteen weight rows are the A
// operand, the x rows the 8 columns of B (columns >= R are zero).
//
// Exact dequantization to bf16, no float conversion: a nibble is looked up (PRMT) as the low byte
// 16 +- v of the bf16 144 +- v, v = 2 |e2m1| in {0, 1, 2, 3, 4, 6, 8, 12}, and one bf16 FMA per pair
// gives (144 +- v) * s - 144 * s = +-v * s with s = e4m3 * 2^-8 (at most 6 significant bits:
// exact). The products are exact in fp32; the sums are scaled by scale_2 * 128 at the end.
// An E4M3 NaN scale (0x7f) is not special-cased (ModelOpt never writes one).
//
// Work split: a block is NVFP4_WARPS warps; `ksplit` consecutive warps share a group of sixteen
// weight rows (of one projection, or of gate AND up), each sweeping a contiguous slice of K in
// steps of four 16-byte chunks (128 k): lane (g, t) = (lane / 4, lane % 4) streams chunk 4 s + t of
// weight rows n0 + g and n0 + g + 8 and reads the same 32 k of x row g. The k order inside an mma
// is free, so both operands simply use the chunk's own order. Slices meet in shared memory, added
// in slice order. Lane (g, t) ends with x rows 2t, 2t + 1 of weight rows n0 + g, n0 + g + 8.
//
// Entry points (grids computed in glm_ep/backend/cuda/routed.py):
//   nvfp4_mma_gemv              one weight, scale_2 by value              grid (groups, 1)
//   nvfp4_mma_moe_gemv          one row, every top-k slot                 grid (groups, slots)
//   nvfp4_mma_moe_glu           same, gate + up + clamped SwiGLU fused    grid (groups, slots)
//   nvfp4_mma_moe_gemv_union    R = 2..8 rows, one sweep per union expert grid (groups, R*top_k)
//   nvfp4_mma_moe_glu_union     same, gate + up + SwiGLU fused            grid (groups, R*top_k)
// A slot or union entry whose expert id is outside [start, start + count) leaves its output untouched.
//
// NumPy twin: NumpyBackend.moe_gemv, moe_gate_up_act, moe_gemv_union, moe_gate_up_act_union and expert_linear
// (glm_ep/backend/numpy_backend.py); held together by tests/cuda/test_cuda_routed.py, test_cuda_union.py (the block
// kernels) and test_cuda_ring.py (the ring off, and launches of few items).
#include "common.cuh"
#include "nvfp4_mma.cuh"

#ifndef NVFP4_WARPS
#error "NVFP4_WARPS is set by glm_ep/backend/cuda/kernel_loader.py"
#endif
#define MMA_THREADS (NVFP4_WARPS * 32)
#ifndef MMA_ROWS
#error "MMA_ROWS is set by glm_ep/backend/cuda/kernel_loader.py"
#endif
static_assert(MMA_ROWS == 16, "a warp group's weight rows are the m16n8k16 mma's A operand");

// Issue the loads of step s (4 chunks: lane t takes chunk 4 s + t) of the lane's 2P weight rows
// (row 2p: n0 + g, row 2p + 1: n0 + g + 8 of matrix p); zeros past the slice, past K, or for a row
// past N (wrow == nullptr).
template <int P>
__device__ __forceinline__ void load_step(const unsigned char* const (&wrow)[2 * P],
                                          const unsigned char* const (&srow)[2 * P], int nchunk, int s, int s_hi,
                                          uint4 (&w)[2 * P], unsigned (&sc)[2 * P]) {
    const int c = 4 * s + (threadIdx.x & 3);
    const bool live = s < s_hi && c < nchunk;
#pragma unroll
    for (int i = 0; i < 2 * P; ++i) {
        if (live && wrow[i]) {
            w[i] = ld_stream_v4(wrow[i] + 16 * (size_t)c);
            sc[i] = ld_stream_u16(srow[i] + 2 * (size_t)c);
        } else {
            w[i] = make_uint4(0u, 0u, 0u, 0u);
            sc[i] = 0u;
        }
    }
}

// Step s: the lane's 32 k of x row g (xrow == nullptr: zeros) against the loaded weight chunks.
template <int P>
__device__ __forceinline__ void compute_step(const uint4 (&w)[2 * P], const unsigned (&sc)[2 * P], const bf16_t* xrow,
                                             int nchunk, int s, float (&acc)[P][4]) {
    const int c = 4 * s + (threadIdx.x & 3);
    uint4 xv[4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
        xv[i] = (xrow && c < nchunk) ? ld_cached_v4(xrow + 32 * (size_t)c + 8 * i) : make_uint4(0u, 0u, 0u, 0u);
    mma_chunks<P>(w, sc, xv, acc);
}

#define MMA_DEPTH(P) ((P) == 1 ? 3 : 2)  // steps of weight loads in flight per lane

// One warp: the lane's weight rows of P matrices against x row g over steps [s_lo, s_hi), a ring
// of MMA_DEPTH steps of loads in flight. acc[p] = (row n0 + g, x rows 2t, 2t + 1), (row n0 + g + 8,
// x rows 2t, 2t + 1).
template <int P>
__device__ __forceinline__ void mma_sweep(const unsigned char* const (&wrow)[2 * P],
                                          const unsigned char* const (&srow)[2 * P], const bf16_t* xrow, int nchunk,
                                          int s_lo, int s_hi, float (&acc)[P][4]) {
    constexpr int D = MMA_DEPTH(P);
#pragma unroll
    for (int p = 0; p < P; ++p)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[p][i] = 0.0f;
    uint4 w[D][2 * P];
    unsigned sc[D][2 * P];
#pragma unroll
    for (int d = 0; d < D; ++d) load_step<P>(wrow, srow, nchunk, s_lo + d, s_hi, w[d], sc[d]);
    for (int s = s_lo; s < s_hi; s += D) {
#pragma unroll
        for (int d = 0; d < D; ++d) {
            if (s + d >= s_hi) break;  // warp-uniform
            compute_step<P>(w[d], sc[d], xrow, nchunk, s + d, acc);
            load_step<P>(wrow, srow, nchunk, s + d + D, s_hi, w[d], sc[d]);
        }
    }
}

struct Group {
    int n0, s_lo, s_hi;
};

// This warp's sixteen weight rows and K slice.
__device__ __forceinline__ Group group_of(int K, int ksplit) {
    const int warp = threadIdx.x >> 5, ks = warp % ksplit;
    const int steps = ((K >> 5) + 3) >> 2, per = (steps + ksplit - 1) / ksplit;
    const int lo = min(steps, ks * per);
    return Group{((int)blockIdx.x * (NVFP4_WARPS / ksplit) + warp / ksplit) * MMA_ROWS, lo, min(steps, lo + per)};
}

// The row group's slices added in order; true in the warp that then holds the totals.
template <int P>
__device__ __forceinline__ bool slices_sum(float (&acc)[P][4], int ksplit) {
    __shared__ float red[NVFP4_WARPS][32][4 * P];
    if (ksplit == 1) return true;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
#pragma unroll
    for (int p = 0; p < P; ++p)
#pragma unroll
        for (int i = 0; i < 4; ++i) red[warp][lane][4 * p + i] = acc[p][i];
    __syncthreads();
    if (warp % ksplit) return false;
    for (int j = 1; j < ksplit; ++j)
#pragma unroll
        for (int p = 0; p < P; ++p)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[p][i] += red[warp + j][lane][4 * p + i];
    return true;
}

__device__ __forceinline__ void lane_rows(const unsigned char* packed, const unsigned char* scale, int n0, int N,
                                          int K, const unsigned char*& w0, const unsigned char*& w1,
                                          const unsigned char*& s0, const unsigned char*& s1) {
    const int n = n0 + ((threadIdx.x & 31) >> 2);
    w0 = n < N ? packed + (size_t)n * (K >> 1) : nullptr;
    s0 = n < N ? scale + (size_t)n * (K >> 4) : nullptr;
    w1 = n + 8 < N ? packed + (size_t)(n + 8) * (K >> 1) : nullptr;
    s1 = n + 8 < N ? scale + (size_t)(n + 8) * (K >> 4) : nullptr;
}

// One projection. xrow: x row g of this lane (nullptr: none); out[i]: the output row of x row
// 2t + i (nullptr: not part of this launch).
__device__ __forceinline__ void mma_project(const unsigned char* packed, const unsigned char* scale, float scale2,
                                            const bf16_t* xrow, bf16_t* const (&out)[2], int N, int K, int ksplit) {
    const Group grp = group_of(K, ksplit);
    const unsigned char* wr[2];
    const unsigned char* sr[2];
    lane_rows(packed, scale, grp.n0, N, K, wr[0], wr[1], sr[0], sr[1]);
    float acc[1][4];
    mma_sweep<1>(wr, sr, xrow, K >> 5, grp.s_lo, grp.s_hi, acc);
    if (!slices_sum<1>(acc, ksplit)) return;
    const float f = scale2 * 128.0f;
    const int n = grp.n0 + ((threadIdx.x & 31) >> 2);
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        if (!out[i]) continue;
        if (n < N) out[i][n] = f32_to_bf16(acc[0][i] * f);
        if (n + 8 < N) out[i][n + 8] = f32_to_bf16(acc[0][2 + i] * f);
    }
}

// Gate + up + SwiGLU: outputs as in mma_project, one (gate, up, act) triple per x row.
__device__ __forceinline__ void mma_glu(const unsigned char* gp, const unsigned char* gs, float g2,
                                        const unsigned char* up, const unsigned char* us, float u2,
                                        const bf16_t* xrow, bf16_t* const (&gate)[2], bf16_t* const (&upo)[2],
                                        bf16_t* const (&act)[2], int N, int K, int ksplit, float limit) {
    const Group grp = group_of(K, ksplit);
    const unsigned char* wr[4];
    const unsigned char* sr[4];
    lane_rows(gp, gs, grp.n0, N, K, wr[0], wr[1], sr[0], sr[1]);
    lane_rows(up, us, grp.n0, N, K, wr[2], wr[3], sr[2], sr[3]);
    float acc[2][4];
    mma_sweep<2>(wr, sr, xrow, K >> 5, grp.s_lo, grp.s_hi, acc);
    if (!slices_sum<2>(acc, ksplit)) return;
    const float fg = g2 * 128.0f, fu = u2 * 128.0f;
    const int n = grp.n0 + ((threadIdx.x & 31) >> 2);
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        if (!act[i]) continue;
        if (n < N) glu_store(gate[i], upo[i], act[i], n, acc[0][i] * fg, acc[1][i] * fu, limit);
        if (n + 8 < N) glu_store(gate[i], upo[i], act[i], n + 8, acc[0][2 + i] * fg, acc[1][2 + i] * fu, limit);
    }
}

__device__ __forceinline__ bool local_expert(int id, int start, int count, int& local) {
    local = id - start;
    return id >= 0 && local >= 0 && local < count;
}

// ---- entry points (blocks retire as a whole: no barrier precedes a return) -------------------
// One x row: lanes of group g = 0 feed it to the mma, lanes with t = 0 write its outputs.
__device__ __forceinline__ bool feeds_row0() { return (threadIdx.x & 31) < 4; }
__device__ __forceinline__ bool writes_row0() { return (threadIdx.x & 3) == 0; }

extern "C" __global__ void __launch_bounds__(MMA_THREADS)
nvfp4_mma_gemv(const bf16_t* __restrict__ x, const unsigned char* __restrict__ packed,
               const unsigned char* __restrict__ scale, float scale2, bf16_t* __restrict__ out, int N, int K,
               int ksplit) {
    pdl_enter();
    bf16_t* const o[2] = {writes_row0() ? out : nullptr, nullptr};
    mma_project(packed, scale, scale2, feeds_row0() ? x : nullptr, o, N, K, ksplit);
}

extern "C" __global__ void __launch_bounds__(MMA_THREADS)
nvfp4_mma_moe_gemv(const bf16_t* __restrict__ x, long long x_slot_stride, const u64_t* __restrict__ packed_ptrs,
                   const u64_t* __restrict__ scale_ptrs, const float* __restrict__ scale2,
                   const int* __restrict__ ids, int start, int count, bf16_t* __restrict__ out, int N, int K,
                   int ksplit) {
    pdl_enter();
    const int slot = blockIdx.y;
    int e;
    if (!local_expert(ids[slot], start, count, e)) return;
    bf16_t* const o[2] = {writes_row0() ? out + (size_t)slot * N : nullptr, nullptr};
    mma_project((const unsigned char*)packed_ptrs[e], (const unsigned char*)scale_ptrs[e], scale2[e],
                feeds_row0() ? x + slot * x_slot_stride : nullptr, o, N, K, ksplit);
}

extern "C" __global__ void __launch_bounds__(MMA_THREADS)
nvfp4_mma_moe_glu(const bf16_t* __restrict__ x, const u64_t* __restrict__ gate_packed,
                  const u64_t* __restrict__ gate_scale, const float* __restrict__ gate_scale2,
                  const u64_t* __restrict__ up_packed, const u64_t* __restrict__ up_scale,
                  const float* __restrict__ up_scale2, const int* __restrict__ ids, int start, int count,
                  bf16_t* __restrict__ gate, bf16_t* __restrict__ up, bf16_t* __restrict__ act, int N, int K,
                  int ksplit, float limit) {
    pdl_enter();
    const int slot = blockIdx.y;
    int e;
    if (!local_expert(ids[slot], start, count, e)) return;
    const size_t off = (size_t)slot * N;
    const bool w = writes_row0();
    bf16_t* const g[2] = {gate + off, nullptr};
    bf16_t* const u[2] = {up + off, nullptr};
    bf16_t* const a[2] = {w ? act + off : nullptr, nullptr};
    mma_glu((const unsigned char*)gate_packed[e], (const unsigned char*)gate_scale[e], gate_scale2[e],
            (const unsigned char*)up_packed[e], (const unsigned char*)up_scale[e], up_scale2[e],
            feeds_row0() ? x : nullptr, g, u, a, N, K, ksplit, limit);
}

// Union entry y (grid.y): expert u_eid[y]; x row r took it in slot u_slot[y, r] (-1: it did not).
__device__ __forceinline__ int union_slot(const int* u_slot, int R, int r) {
    return r < R ? u_slot[blockIdx.y * R + r] : -1;
}

extern "C" __global__ void __launch_bounds__(MMA_THREADS)
nvfp4_mma_moe_gemv_union(const bf16_t* __restrict__ x, long long x_row_stride, long long x_slot_stride,
                         const u64_t* __restrict__ packed_ptrs, const u64_t* __restrict__ scale_ptrs,
                         const float* __restrict__ scale2, const int* __restrict__ u_eid, const int* __restrict__ u_slot,
                         int R, int start, int count, bf16_t* __restrict__ out, long long out_row_stride, int N,
                         int K, int ksplit) {
    pdl_enter();
    int e;
    if (!local_expert(u_eid[blockIdx.y], start, count, e)) return;
    const int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
    const int sx = union_slot(u_slot, R, g);
    bf16_t* o[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int r = 2 * t + i, so = union_slot(u_slot, R, r);
        o[i] = so >= 0 ? out + r * out_row_stride + (long long)so * N : nullptr;
    }
    const bf16_t* xr = sx >= 0 ? x + g * x_row_stride + sx * x_slot_stride : nullptr;
    bf16_t* const oc[2] = {o[0], o[1]};
    mma_project((const unsigned char*)packed_ptrs[e], (const unsigned char*)scale_ptrs[e], scale2[e], xr, oc, N, K,
                ksplit);
}

extern "C" __global__ void __launch_bounds__(MMA_THREADS)
nvfp4_mma_moe_glu_union(const bf16_t* __restrict__ x, long long x_row_stride, const u64_t* __restrict__ gate_packed,
                        const u64_t* __restrict__ gate_scale, const float* __restrict__ gate_scale2,
                        const u64_t* __restrict__ up_packed, const u64_t* __restrict__ up_scale,
                        const float* __restrict__ up_scale2, const int* __restrict__ u_eid,
                        const int* __restrict__ u_slot, int R, int start, int count, bf16_t* __restrict__ gate,
                        bf16_t* __restrict__ up, bf16_t* __restrict__ act, long long out_row_stride, int N, int K,
                        int ksplit, float limit) {
    pdl_enter();
    int e;
    if (!local_expert(u_eid[blockIdx.y], start, count, e)) return;
    const int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
    const int sx = union_slot(u_slot, R, g);
    bf16_t* gp[2];
    bf16_t* upp[2];
    bf16_t* ap[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int r = 2 * t + i, so = union_slot(u_slot, R, r);
        const long long off = r * out_row_stride + (long long)so * N;
        gp[i] = gate + off;
        upp[i] = up + off;
        ap[i] = so >= 0 ? act + off : nullptr;
    }
    bf16_t* const g2[2] = {gp[0], gp[1]};
    bf16_t* const u2[2] = {upp[0], upp[1]};
    bf16_t* const a2[2] = {ap[0], ap[1]};
    mma_glu((const unsigned char*)gate_packed[e], (const unsigned char*)gate_scale[e], gate_scale2[e],
            (const unsigned char*)up_packed[e], (const unsigned char*)up_scale[e], up_scale2[e],
            sx >= 0 ? x + g * x_row_stride : nullptr, g2, u2, a2, N, K, ksplit, limit);
}
