// Grouped NVFP4 (W4A16) GEMM on the tensor cores: the prefill of the routed experts, every local
// expert in ONE launch per projection, gate + up + clamped SwiGLU fused into one:
//
//   out[i, n] = bf16(scale_2[e] * sum_k x[row(i), k] * e2m1[n, k] * e4m3[n, k / 16])
//
// for the expert-sorted slots i of local expert e (expert_offsets[start + e] <= i < ...[start + e + 1]);
// row(i) = sorted_token_ids[i] (gate/up gather the token rows) or i (down reads sorted activations).
// Without expert_offsets (nullptr) one expert, local 0, owns every one of the `slots` rows in order.
//
// Tiles: a block computes BM sorted rows of ONE expert x BN weight rows (the fused GLU: BN / 2 gate
// rows and the same BN / 2 up rows). Three engines share the tiling and the copies; the wgmma engine's sums are
// transposed (a thread holds weight rows, not x rows), so the epilogue has a branch for them (G::TRANSPOSED):
//   register (WM = 1): every warp on all BM rows and 32 weight rows, dequantizing its own weights in
//     registers, with the x rows as the mma's m16 side or (narrow) as its n8 side (Gemm, gemm_nvfp4_register.cuh);
//   tiled (WM > 1): a WM x WN warp grid over the tile, the weight tile dequantized ONCE per stage into
//     shared memory, both operands by ldmatrix (GemmTiled, gemm_nvfp4_tiled.cuh);
//   wgmma (sm_90a): the weights dequantized straight into wgmma's register A operand by bit placement, the x
//     rows its n side, read in a staged k order (stage_k64 writes it once a call; gate + up writes act in it),
//     two or four warpgroups of 64 weight rows (GemmWg, gemm_nvfp4_wgmma.cuh; the copies are the tiled engine's).
// The variants (BM 16 .. 128) let a width whose experts hold few rows each skip the mma work and
// x staging of empty rows; the wrapper picks one from the expected rows per expert. blockIdx.x =
// tile * n_blocks + n_block, so the blocks of one row tile sweep the weight rows back to back while
// its x rows sit in L2. A block finds its (expert, row tile) by a scan of the local experts' tile
// counts ceil(rows / BM); remote experts own no tiles, and blocks past the last tile return at once
// (the grid is sized from the slot count on the host, so nothing waits on the device).
//
// Pipeline: STAGES shared-memory stages of BK k (x rows, packed weights, E4M3 scales)
// filled by cp.async; x rows past the expert's last and weight rows past N are zero-filled.
//
// The register engine: mma.sync m16n8k16 with A = x (16 rows) and B = weights (8 weight rows as the
// columns), or narrow, A = weights (16 rows) and B = x (8 rows), fp32 accumulators. The k order inside an
// mma is free as long as A and B agree lane by lane: lane (g, t) of a 32-k step takes the 8 consecutive
// k 8t .. 8t + 7 of its x rows (one 16-byte load per row) and of its weight row (one 4-byte word of packed
// weights), the pairs (8t, 8t+1), (8t+2, 8t+3) feeding the first mma and (8t+4, 8t+5), (8t+6, 8t+7) the second.
//
// Dequantization, exact: a nibble's magnitude picks (PRMT, as a byte index into two constant words) the
// low and the high byte of the bf16 e2m1 value in {0, 0.5, 1, 1.5, 2, 3, 4, 6}, its sign is ORed into the
// high byte and one PRMT per pair interleaves the bytes (19 integer instructions per 8 nibbles, against
// 21 for placing the bits into a bf16 that reads e2m1 * 2^-126); one bf16 multiply by the block scale
// held as e4m3 * 2^-8 gives e2m1 * e4m3 * 2^-8: at most 6 significant bits and inside bf16's normal
// range, so exact. The fp32 sums are scaled by scale_2 * 2^8 in the epilogue. No per-element float
// conversion. The placed variants (GEMM_PLACED) make the same products by bit placement instead
// (dequant_word_placed: fewer integer-pipe instructions, the x chunks paired to match).
//
// Entry points, one per GEMM_NARROW / GEMM_PLACED / GEMM_VARIANT / GEMM_TILED / GEMM_WGMMA line below (grids
// computed in glm_ep/backend/cuda/grouped.py; SUFFIX m{BM}w{W}k{BK}n, m{BM}w{W}k{BK}p, m{BM}w{W}k{BK},
// m{BM}w{WM}x{WN}k{BK} or m{BM}wg{WN}k64):
//   nvfp4_gemm_sorted_SUFFIX       one projection                        grid (tiles * ceil(N / BN), splits)
//   nvfp4_gemm_sorted_glu_SUFFIX   gate + up + SwiGLU, writes act only   grid (tiles * ceil(N / (BN / 2)), splits)
//   nvfp4_gemm_reduce[_glu]        a K split's second pass               grid (slots * N / 4 threads)
//   nvfp4_dequant_bf16             one expert's weights as exact bf16    grid-stride, a thread per 4 words a round
// K split (gridDim.y = splits > 1, for grids with fewer blocks than SMs; gemm_nvfp4_split.cuh): block y
// streams its share of K and writes fp32 partial sums (scale_2 applied) instead of bf16; the reduce adds them
// in split order and rounds once, as the unsplit epilogue does (for the glu: gate and up to bf16, then the SwiGLU).
//
// NumPy twin: NumpyBackend.moe_gate_up_act_sorted, moe_gemm_sorted, dequant_linear; held together by
// tests/cuda/test_cuda_gemm.py (every variant, engine and K split) and tests/cuda/test_cuda_paths.py (prefill paths).
#include "common.cuh"
#include "nvfp4_mma.cuh"
#include "async_copy.cuh"

#define GEMM_NT 4  // n8 tiles of a warp: 32 weight rows

// One pipeline stage of a BM x BN tile, BK k. x chunk c (8 k) of row r sits at the register engine's
// Gemm::x_slot(c, r), chosen so that the lanes reading at once hit disjoint banks; weight piece h (32 k, 16 bytes) of
// row n at w_slot<BK>(n, h), so the 8 rows of an n8 tile read disjoint banks.
template <int BM, int BN, int BK>
struct GemmStage {
    static_assert(BK == 64 || BK == 128, "a row's BK / 16 scale bytes are one 4- or 8-byte copy");
    uint4 x[BM][BK / 8];
    uint4 w[BN][BK / 32];
    unsigned s[BN][BK / 64];  // the row's BK / 16 E4M3 scale bytes
};

// Rows per 128 bytes of packed weights: 256 / BK; rows n and n + that share banks, so their pieces rotate.
template <int BK>
__device__ __forceinline__ int w_slot(int n, int h) {
    return h ^ ((n / (256 / BK)) % (BK / 32));
}

struct RowTile {
    int e, row0, rows;  // local expert, first sorted row, rows (<= BM); e = -1: no tile
};

// Tile `tile` of the local experts' row tiles, in expert order (one warp scans, 32 experts a step;
// no early exit, so the offset loads of every step are in flight together). offsets == nullptr: ONE
// expert (local 0) owns all `slots` rows, in order (a dense FFN stored NVFP4: no routing to read).
template <int BM>
__device__ __forceinline__ RowTile find_tile(const int* offsets, int start, int count, int tile, int slots) {
    if (offsets == nullptr)
        return tile * BM < slots ? RowTile{0, tile * BM, min(BM, slots - tile * BM)} : RowTile{-1, 0, 0};
    __shared__ RowTile found;
    if (threadIdx.x < 32) {
        const int lane = threadIdx.x;
        if (lane == 0) found.e = -1;
        __syncwarp();
        int before = 0;  // row tiles of the experts already scanned
#pragma unroll 4
        for (int base = 0; base < count; base += 32) {
            const int e = base + lane;
            int lo = 0, rows = 0;
            if (e < count) {
                lo = offsets[start + e];
                rows = offsets[start + e + 1] - lo;
            }
            const int n = (rows + BM - 1) / BM, incl = warp_inclusive_sum(n);
            const int first = before + incl - n;
            if (tile >= first && tile < first + n) {
                const int r0 = (tile - first) * BM;
                found = RowTile{e, lo + r0, min(BM, rows - r0)};
            }
            before += __shfl_sync(0xffffffffu, incl, 31);
        }
    }
    __syncthreads();
    return found;
}

// The lookup words of dequant_word: the low and high bytes of bf16 |e2m1| for magnitudes 0..3 and 4..7.
struct DequantLut {
    unsigned lo0, lo1, hi0, hi1;

    static __device__ __forceinline__ DequantLut constants() {
        return {0xc0800000u, 0xc0804000u, 0x3f3f3f00u, 0x40404040u};
    }

    // The same words in per-thread registers. ptxas keeps constant words in uniform registers and copies
    // each into a per-thread one before every PRMT that reads it as data; ORed with a zero it cannot fold
    // (the dynamic shared memory size is below 2^30) they stay per thread: four registers held for a tile.
    static __device__ __forceinline__ DequantLut per_thread() {
        unsigned dyn;
        asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn));
        const unsigned z = (dyn >> 30) * threadIdx.x;
        const DequantLut c = constants();
        return {c.lo0 | z, c.lo1 | z, c.hi0 | z, c.hi1 | z};
    }
};

// 8 nibbles (one word, k 2j in the low and 2j + 1 in the high nibble of byte j) times a block scale
// held as the bf16 pair (e4m3 * 2^-8, e4m3 * 2^-8): b[j] = (k 2j, k 2j + 1) as an exact bf16 pair.
__device__ __forceinline__ void dequant_word(unsigned q, unsigned scale2x, unsigned (&b)[4],
                                             const DequantLut& lut = DequantLut::constants()) {
    const unsigned m = q & 0x77777777u, sh = q << 4;  // magnitudes; byte j's high nibble = q byte j's low nibble
#pragma unroll
    for (int h = 0; h < 2; ++h) {  // nibbles 4h .. 4h + 3: bytes 2h and 2h + 1
        unsigned p0, p1;  // |e2m1| with its sign
        lookup_bf16_pairs(q, m, sh, h, lut.lo0, lut.lo1, lut.hi0, lut.hi1, p0, p1);
        b[2 * h] = fma_bf16x2(p0, scale2x, 0x80008000u);  // exact product (+ -0)
        b[2 * h + 1] = fma_bf16x2(p1, scale2x, 0x80008000u);
    }
}

// An E4M3 byte as the bf16 pair (e4m3 * 2^-8 * factor, twice): the bits shifted into an fp16 (e4m3 * 2^-8,
// subnormals included), widened to fp32, times the power of two `factor`, cut to bf16 (exact: 4 significant bits).
__device__ __forceinline__ unsigned scale_pair(unsigned byte, float factor = 1.0f) {
    const unsigned h = ((byte & 0x80u) << 8) | ((byte & 0x7fu) << 7);
    float lo, hi;
    f16x2_to_f32(h, lo, hi);
    return prmt(__float_as_uint(lo * factor), 0u, 0x3232u);
}

// Both E4M3 bytes of s16 (bytes 0 and 1) at once: s[i] = scale_pair(byte i), one fp16 pair widened.
__device__ __forceinline__ void scale_pairs(unsigned s16, unsigned (&s)[2]) {
    float f[2];
    chunk_scales_f32(s16, f[0], f[1]);
    s[0] = prmt(__float_as_uint(f[0]), 0u, 0x3232u);
    s[1] = prmt(__float_as_uint(f[1]), 0u, 0x3232u);
}

// Two E4M3 bytes held in bytes 1 and 3 of v (bytes 0 and 2 are ignored) as the bf16 pair e4m3 x 2^-120, by bit
// placement: the sign to bit 15 / 31, exponent and mantissa to bits 10..4 / 26..20. An E4M3 subnormal (exponent 0)
// lands on a bf16 subnormal of the same mantissa, so every byte is exact (0x7f / 0xff as +-480, as scale_pair takes
// them); fma_bf16x2 takes the subnormals as they are. 3 instructions for two scales, against scale_pairs' 11.
__device__ __forceinline__ unsigned e4m3_pair_placed(unsigned v) {
    return (v & 0x80008000u) | ((v >> 4) & 0x07f007f0u);
}

// The same two bytes as the bf16 pair e4m3 x 2^118, the block scales dequant_word_placed takes: e4m3 x 2^-120
// times 2^119 twice (2^238 is no bf16; each product is exact, a power of two into a normal result).
__device__ __forceinline__ unsigned e4m3_pair_placed_x2p118(unsigned v) {
    const unsigned f = exp2i_bf16x2(119);
    return fma_bf16x2(fma_bf16x2(e4m3_pair_placed(v), f, 0x80008000u), f, 0x80008000u);
}

// Half h of a bf16 pair in both halves: ptxas folds it into the multiply that reads it (.H0_H0 / .H1_H1).
__device__ __forceinline__ unsigned bf16x2_bcast(unsigned v, int h) {
    unsigned d;
    if (h)
        asm("{\n\t.reg .b16 l, h;\n\tmov.b32 {l, h}, %1;\n\tmov.b32 %0, {h, h};\n\t}" : "=r"(d) : "r"(v));
    else
        asm("{\n\t.reg .b16 l, h;\n\tmov.b32 {l, h}, %1;\n\tmov.b32 %0, {l, l};\n\t}" : "=r"(d) : "r"(v));
    return d;
}

// The placed form of one word (nvfp4_mma.cuh's placed_pairs: no lookup) times a block scale held as the
// bf16 pair (e4m3 * 2^118, twice): b[p] = k p and p + 4 of the word as e2m1 x e4m3 x 2^-8, the products
// dequant_word makes (the placed e2m1 x 2^-126, +-0.5 a bf16 subnormal, times e4m3 x 2^118: at most 6
// significant bits and normal, so exact). Its left shifts are IMAD and its right shifts IMAD.HI, on the FMA
// pipe; 8 LOP3 a word on the integer pipe, against 15 integer instructions of the lookup. The x pair an mma
// meets must hold the same two k (pair_halves).
__device__ __forceinline__ void dequant_word_placed(unsigned v, unsigned scale2x, unsigned (&b)[4]) {
    unsigned p[4];
    placed_pairs(v, p);
#pragma unroll
    for (int i = 0; i < 4; ++i) b[i] = fma_bf16x2(p[i], scale2x, 0x80008000u);  // exact product (+ -0)
}

#include "gemm_nvfp4_register.cuh"
#include "gemm_nvfp4_tiled.cuh"
#include "gemm_nvfp4_wgmma.cuh"
#include "gemm_nvfp4_split.cuh"

template <class G>
__device__ __forceinline__ void gemm_sorted(const bf16_t* __restrict__ x, const int* __restrict__ sorted_token_ids,
                                            const int* __restrict__ expert_offsets,
                                            const u64_t* __restrict__ packed_ptrs,
                                            const u64_t* __restrict__ scale_ptrs, const float* __restrict__ scale2,
                                            int start, int count, bf16_t* __restrict__ out, int N, int K,
                                            int n_blocks, float* __restrict__ partials, int slots) {
    const RowTile tile = find_tile<G::BM>(expert_offsets, start, count, blockIdx.x / n_blocks, slots);
    if (tile.e < 0) return;
    const KSlice ks = k_slice<G::K_STEP>(K);
    const int half = G::BN / 2, n0 = (blockIdx.x % n_blocks) * G::BN;
    const unsigned char* packed = (const unsigned char*)packed_ptrs[tile.e] + ks.k0 / 2;
    const unsigned char* scale = (const unsigned char*)scale_ptrs[tile.e] + ks.k0 / 16;
    const unsigned char* const wb[2] = {packed + (size_t)n0 * (K >> 1), packed + (size_t)(n0 + half) * (K >> 1)};
    const unsigned char* const sb[2] = {scale + (size_t)n0 * (K >> 4), scale + (size_t)(n0 + half) * (K >> 4)};
    const int valid[2] = {N - n0, N - n0 - half};
    const float f = scale2[tile.e] * 256.0f;
    const bool split = gridDim.y > 1;
    G gemm;
    if constexpr (G::TRANSPOSED) {  // d[4 j + 2 h + c]: tile row h half + r against x row 8 j + 2 t + c
        float d[64] = {};
        gemm.run(x + ks.k0, sorted_token_ids, tile, wb, sb, valid, K, ks.blocks, d);
        const int r = G::row(), t = threadIdx.x & 3;
#pragma unroll
        for (int j = 0; j < 16; ++j)
#pragma unroll
            for (int c = 0; c < 2; ++c) {
                const int i = 8 * j + 2 * t + c;
                if (i >= tile.rows) continue;
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    if (r >= valid[h]) continue;
                    const int n = n0 + h * half + r;
                    const float v = d[4 * j + 2 * h + c] * f;
                    if (split)
                        partial_row(partials, 1, 0, slots, tile.row0 + i, N)[n] = v;
                    else
                        out[(size_t)(tile.row0 + i) * N + n] = f32_to_bf16(v);
                }
            }
    } else {
        constexpr int MT = G::M_TILES, NT = G::N_TILES;
        const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
        // the warp's weight rows and x rows
        const int wn = warp % G::WARP_COLS, m0 = (warp / G::WARP_COLS) * G::M0_STEP;
        int wr[NT];
#pragma unroll
        for (int j = 0; j < NT; ++j) wr[j] = 8 * NT * wn + 8 * j;
        float acc[MT][NT][4] = {};  // the engines add to it
        gemm.run(x + ks.k0, sorted_token_ids, tile, wb, sb, valid, K, ks.blocks, wr, m0, acc);
#pragma unroll
        for (int i = 0; i < MT; ++i)
#pragma unroll
            for (int h = 0; h < 2; ++h) {  // rows g and g + 8 of m16 tile i
                const int r = m0 + G::M_STRIDE * i + g + 8 * h;
                if (r >= tile.rows) continue;
                bf16_t* o = out + (size_t)(tile.row0 + r) * N;
                float* p = split ? partial_row(partials, 1, 0, slots, tile.row0 + r, N) : nullptr;
#pragma unroll
                for (int j = 0; j < NT; ++j) {
                    const int n = n0 + 8 * NT * wn + 8 * j + 2 * t;
                    if (n >= N) continue;
                    const float v0 = acc[i][j][2 * h] * f, v1 = acc[i][j][2 * h + 1] * f;
                    if (split)
                        *reinterpret_cast<float2*>(p + n) = make_float2(v0, v1);
                    else
                        *reinterpret_cast<unsigned*>(o + n) = (unsigned)f32_to_bf16(v0) | ((unsigned)f32_to_bf16(v1) << 16);
                }
            }
    }
}

template <class G>
__device__ __forceinline__ void gemm_sorted_glu(const bf16_t* __restrict__ x, const int* __restrict__ sorted_token_ids,
                                                const int* __restrict__ expert_offsets,
                                                const u64_t* __restrict__ gate_packed,
                                                const u64_t* __restrict__ gate_scale,
                                                const float* __restrict__ gate_scale2,
                                                const u64_t* __restrict__ up_packed,
                                                const u64_t* __restrict__ up_scale, const float* __restrict__ up_scale2,
                                                int start, int count, bf16_t* __restrict__ act, int N, int K,
                                                int n_blocks, float limit, float* __restrict__ partials, int slots,
                                                int act_staged) {
    const RowTile tile = find_tile<G::BM>(expert_offsets, start, count, blockIdx.x / n_blocks, slots);
    if (tile.e < 0) return;
    const KSlice ks = k_slice<G::K_STEP>(K);
    const int half = G::BN / 2, n0 = (blockIdx.x % n_blocks) * half;  // tile rows [0, half): gate, then up
    const size_t w0 = (size_t)n0 * (K >> 1) + ks.k0 / 2, s0 = (size_t)n0 * (K >> 4) + ks.k0 / 16;
    const unsigned char* const wb[2] = {(const unsigned char*)gate_packed[tile.e] + w0,
                                        (const unsigned char*)up_packed[tile.e] + w0};
    const unsigned char* const sb[2] = {(const unsigned char*)gate_scale[tile.e] + s0,
                                        (const unsigned char*)up_scale[tile.e] + s0};
    const int valid[2] = {N - n0, N - n0};
    const float fg = gate_scale2[tile.e] * 256.0f, fu = up_scale2[tile.e] * 256.0f;
    const bool split = gridDim.y > 1;
    G gemm;
    if constexpr (G::TRANSPOSED) {  // d[4 j + c]: gate row r, d[4 j + 2 + c]: up row r, x row 8 j + 2 t + c
        float d[64] = {};
        gemm.run(x + ks.k0, sorted_token_ids, tile, wb, sb, valid, K, ks.blocks, d);
        const int r = G::row(), t = threadIdx.x & 3;
        if (r >= valid[0]) return;
        const int n = act_staged ? staged_column(n0 + r) : n0 + r;  // the down projection's x order (stage_k64)
#pragma unroll
        for (int j = 0; j < 16; ++j)
#pragma unroll
            for (int c = 0; c < 2; ++c) {
                const int i = 8 * j + 2 * t + c;
                if (i >= tile.rows) continue;
                if (split) {  // as below: unrounded sums, the reduce rounds and applies the SwiGLU
                    partial_row(partials, 2, 0, slots, tile.row0 + i, N)[n] = d[4 * j + c] * fg;
                    partial_row(partials, 2, 1, slots, tile.row0 + i, N)[n] = d[4 * j + 2 + c] * fu;
                } else {
                    act[(size_t)(tile.row0 + i) * N + n] =
                        swiglu_one(round_bf16(d[4 * j + c] * fg), round_bf16(d[4 * j + 2 + c] * fu), limit);
                }
            }
    } else {
        constexpr int MT = G::M_TILES, NT = G::N_TILES, NH = NT / 2;
        const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
        const int wn = warp % G::WARP_COLS, m0 = (warp / G::WARP_COLS) * G::M0_STEP;
        int wr[NT];  // n8 tiles [0, NH): gate rows; [NH, NT): the same up rows
#pragma unroll
        for (int j = 0; j < NT; ++j) wr[j] = (j / NH) * half + 8 * NH * wn + 8 * (j % NH);
        float acc[MT][NT][4] = {};  // the engines add to it
        gemm.run(x + ks.k0, sorted_token_ids, tile, wb, sb, valid, K, ks.blocks, wr, m0, acc);
#pragma unroll
        for (int i = 0; i < MT; ++i)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int r = m0 + G::M_STRIDE * i + g + 8 * h;
                if (r >= tile.rows) continue;
                bf16_t* o = act + (size_t)(tile.row0 + r) * N;
                float* pg = split ? partial_row(partials, 2, 0, slots, tile.row0 + r, N) : nullptr;
                float* pu = split ? partial_row(partials, 2, 1, slots, tile.row0 + r, N) : nullptr;
#pragma unroll
                for (int j = 0; j < NH; ++j) {
                    const int n = n0 + 8 * NH * wn + 8 * j + 2 * t;
                    if (n >= N) continue;
                    if (split) {  // the sums go on unrounded; the reduce rounds gate and up and applies the SwiGLU
                        *reinterpret_cast<float2*>(pg + n) = make_float2(acc[i][j][2 * h] * fg, acc[i][j][2 * h + 1] * fg);
                        *reinterpret_cast<float2*>(pu + n) =
                            make_float2(acc[i][j + NH][2 * h] * fu, acc[i][j + NH][2 * h + 1] * fu);
                        continue;
                    }
                    unsigned pair = 0;
#pragma unroll
                    for (int c = 0; c < 2; ++c) {
                        const float gv = round_bf16(acc[i][j][2 * h + c] * fg);
                        const float uv = round_bf16(acc[i][j + NH][2 * h + c] * fu);
                        pair |= (unsigned)swiglu_one(gv, uv, limit) << (16 * c);
                    }
                    *reinterpret_cast<unsigned*>(o + n) = pair;
                }
            }
    }
}

#include "gemm_nvfp4_entries.cuh"

// The stage sweep's build (glm_ep/backend/cuda/kernel_loader.py's GEMM_SWEEP_FILE, `glm-ep bench --prefill
// --gemm-stages`): GEMM_SWEEP holds its instantiations (GEMM_NARROW_OF / GEMM_WGMMA_OF, entries suffixed _s{stages}),
// and the shipped list below is left out.
#ifdef GEMM_SWEEP
GEMM_SWEEP
#else
// Keep in step with GEMM_VARIANTS in glm_ep/backend/cuda/kernel_loader.py (a variant it lacks does not compile).
GEMM_NARROW(8, 1, 4, 64, 4, 4)
GEMM_NARROW(16, 2, 4, 64, 4, 4)
GEMM_NARROW(16, 2, 4, 128, 3, 4)
GEMM_PLACED(16, 2, 4, 128, 3, 4)
GEMM_NARROW(64, 8, 4, 64, 4, 3)
GEMM_VARIANT(64, 4, 8, 128, 3, 1)
GEMM_TILED(128, 4, 2, 4, 64, 3, 2)
GEMM_WGMMA(128, 8, 6, 1)
GEMM_WGMMA(64, 4, 6, 2)
#endif

#include "gemm_nvfp4_dequant.cuh"
