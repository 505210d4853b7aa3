// The grouped GEMM's register engine (WM = 1): every warp on all BM x rows and 32 weight rows of its own,
// dequantizing its weights in registers; mma.sync m16n8k16, fp32 accumulators, in one of two orientations:
//   wide (BM = 16 MT): A = x (16 rows), B = weights (8 weight rows as the columns);
//   narrow (BM = 8 MT): A = weights (16 rows: two n8 tiles of the warp), B = x (8 rows as the columns). An
//     8-row tile pays no mma for 8 empty rows, and the operands need no register moves: the x pair of an mma
//     is one aligned half of a row's 16-byte load, and the weight pairs are the dequantization's own outputs
//     (the wide A fragment interleaves rows g and g + 8 of two loads, which ptxas assembles by moves).
//     The sums are moved into the wide layout by warp shuffles once, after the K loop;
//   placed (narrow, PLACED): the weights dequantized by bit placement (dequant_word_placed), whose pairs hold
//     k p and p + 4 of a word, so the x chunk of every mma is paired to match (pair_halves).
// A narrow lane (g, t) takes words t S .. t S + S - 1 of its weight rows' stage (S = BK / 32 mma steps), k 8 (t S + kk)
// .. + 7 at step kk: one 16- (8-) byte read a row and a stage, and the row's S / 2 block scales from one word (the wide
// lane takes word t of each 32-k piece: S reads and S scales a row).
// An expert's last tile runs the K loop over as many x tiles as its rows need (k_loop_rows).
// Part of gemm_nvfp4.cu, included after its stage layout, row tiles and dequantization (GemmStage, w_slot,
// DequantLut, dequant_word, scale_pairs, GEMM_NT) and common.cuh, nvfp4_mma.cuh and async_copy.cuh
// (glm_ep/backend/cuda/kernel_loader.py inlines them all).
//
// NumPy twin: NumpyBackend.moe_gate_up_act_sorted and moe_gemm_sorted (glm_ep/backend/numpy_backend.py); held
// together by tests/cuda/test_cuda_gemm.py::test_gemm_variants and test_gemm_variants_partial_tiles.
#pragma once

// The block's K loop and its tile geometry: MT x tiles (m16 wide, n8 narrow; every warp covers all of
// them), WARPS warps of 32 weight rows each (BN = 32 WARPS). run() leaves the sums in the wide layout
// (M_TILES m16 tiles) whichever the orientation.
template <int MT, int WARPS, int BK, int STAGES, bool NARROW = false, bool PLACED = false>
struct Gemm {
    static constexpr int BM = (NARROW ? 8 : 16) * MT, BN = 32 * WARPS, THREADS = 32 * WARPS, WARP_COLS = WARPS,
                         M_TILES = (BM + 15) / 16, N_TILES = GEMM_NT, M_STRIDE = 16, M0_STEP = BM, K_STEP = BK;
    static constexpr bool TRANSPOSED = false;  // run() leaves the sums in acc (gemm_sorted's epilogue)
    static constexpr int XCH = BM * BK / 8;  // x copies per stage: one a thread, or fewer copies than threads
    static constexpr int XC = XCH < THREADS ? 1 : XCH / THREADS;  // x copies per thread and stage
    static constexpr int WC = BN * BK / 32 / THREADS;  // weight copies per thread and stage
    static_assert(XCH < THREADS || XC * THREADS == XCH, "x copies split evenly");
    static_assert(WC * THREADS == BN * BK / 32, "weight copies split evenly");
    static_assert(STAGES >= 2, "a pipeline");
    static_assert(NARROW || !PLACED, "the placed form pairs the x rows of the narrow orientation");
    static_assert(MT == 1 || MT == 2 || MT == 4 || MT == 8, "x tiles are left out by powers of two");
    static constexpr int X_TILE = NARROW ? 8 : 16;  // x rows of an mma
    static constexpr int S = BK / 32;                // mma steps (32 k) a stage

    // Where x chunk c (8 k) of tile row r sits in a stage. Narrow: lane (g, t) reads chunk t S + kk of row 8 i + g at
    // step kk, and c ^ 2 (c / 8) ^ (r & 1) puts the 8 chunks a quarter warp reads (rows g and g + 1, t = 0..3) in 8
    // distinct 16-byte bank groups. Wide: c ^ 4 (r & 1), so the lane quads of rows g and g + 1 read disjoint banks.
    static __device__ __forceinline__ int x_slot(int c, int r) {
        return NARROW ? c ^ (((c >> 3) & 1) << 1) ^ (r & 1) : c ^ ((r & 1) << 2);
    }
    using Stage = GemmStage<BM, BN, BK>;

    // This thread's copies, held as TileCopies holds them: every source stays a valid address (a zero-filled
    // copy reads x's first row) and moves one stage along per load, so a stage's copies cost no address
    // arithmetic; the destinations are offsets inside a stage.
    static constexpr unsigned W_OFF = BM * BK * 2, S_OFF = W_OFF + BN * BK / 2;  // GemmStage's w and s
    static_assert(S_OFF + BN * BK / 16 == sizeof(Stage), "GemmStage is x, w, s without padding");
    const unsigned char* xsrc[XC];  // the 16-byte chunk of its x row each x copy takes
    const unsigned char* wsrc[WC];  // each 16-byte weight piece
    const unsigned char* ssrc;      // the scale row (THREADS == BN: one a thread)
    unsigned xdst[XC], wdst[WC];
    unsigned valid;                 // bit i: x copy i, bit XC + i: weight copy i, bit XC + WC: the scales
    static_assert(THREADS == BN, "one thread per weight row copies the stage's scales");
    static_assert(XC + WC < 32, "the copies' valid bits fit a word");

    // Every copy prefetches its 128-byte block into L2: a stage reads 32 bytes of weights and 4 or 8 of scales
    // from each of BN rows (H100, 2026-12-06: gate + up of the narrow 8-row tile 9-13% faster).
    __device__ __forceinline__ void load_stage(unsigned stage) {
#pragma unroll
        for (int i = 0; i < XC; ++i) {
            if (XCH < THREADS && threadIdx.x >= XCH) break;  // a thread past the stage's x copies
            cp_async16_zfill_pf(stage + xdst[i], xsrc[i], (valid >> i) & 1u);
            xsrc[i] += 2 * BK;
        }
#pragma unroll
        for (int i = 0; i < WC; ++i) {
            cp_async16_zfill_pf(stage + wdst[i], wsrc[i], (valid >> (XC + i)) & 1u);
            wsrc[i] += BK / 2;
        }
        cp_async_zfill<BK / 16, true>(stage + S_OFF + threadIdx.x * (BK / 16), ssrc, (valid >> (XC + WC)) & 1u);
        ssrc += BK / 16;
    }

    // Stage kb's turn in the K loop: it has landed (this thread's copies, then everyone's at the barrier), the slot
    // of kb - 1 is free again, and the copies of stage kb + STAGES - 1 go into it (a group committed either way).
    __device__ __forceinline__ void next_stage(int kb, int kblocks, unsigned st0) {
        cp_async_wait<STAGES - 2>();
        __syncthreads();
        const int next = kb + STAGES - 1;
        if (next < kblocks) load_stage(st0 + (next % STAGES) * (unsigned)sizeof(Stage));
        cp_async_commit();
    }

    // The block scales a wide stage's mma steps take, as bf16 pairs: sc[j][kk] for weight row wr[j] + g of the warp's
    // n8 tile j at its 32-k step kk (the 16-k group 2 kk + t / 2), two groups from each 4-byte scale word.
    static __device__ __forceinline__ void stage_scales(const Stage& st, const int (&wr)[GEMM_NT],
                                                        unsigned (&sc)[GEMM_NT][BK / 32]) {
        const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
        const unsigned sel = (t >> 1) | ((2 + (t >> 1)) << 4);  // bytes t / 2 and 2 + t / 2 of a word
#pragma unroll
        for (int j = 0; j < GEMM_NT; ++j)
#pragma unroll
            for (int w = 0; w < BK / 64; ++w) {
                unsigned pair[2];
                scale_pairs(prmt(st.s[wr[j] + g][w], 0u, sel), pair);
                sc[j][2 * w] = pair[0];
                sc[j][2 * w + 1] = pair[1];
            }
    }

    // The sums of the K loop: wide, acc[i][j] (x rows of m16 tile i, weight rows of n8 tile j); narrow, the
    // transposed T[i][jm] (weight rows of n8 tiles 2 jm and 2 jm + 1 as one m16 tile, x rows of n8 tile i).
    using Sums = float[MT][NARROW ? GEMM_NT / 2 : GEMM_NT][4];

    // One 32-k step of a wide warp: its 4 n8 tiles of weight rows (wr[j]: the tile's first) against the first ACTIVE
    // 16-row x tiles (run() leaves out those past the tile's rows). Lane (g, t) dequantizes k 8t .. 8t + 7 of weight
    // row wr[j] + g and reads the same k of its x rows; the pairs (8t, 8t + 1), (8t + 2, 8t + 3) feed the first mma of
    // the step and the next two the second.
    template <int ACTIVE>
    static __device__ __forceinline__ void mma_step(const Stage& st, const int (&wr)[GEMM_NT], int kk,
                                                    const unsigned (&sc)[GEMM_NT][BK / 32], const DequantLut& lut,
                                                    Sums& acc) {
        const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
        unsigned b[GEMM_NT][4];
#pragma unroll
        for (int j = 0; j < GEMM_NT; ++j) {
            const int n = wr[j] + g;
            dequant_word(reinterpret_cast<const unsigned*>(&st.w[n][w_slot<BK>(n, kk)])[t], sc[j][kk], b[j], lut);
        }
        const int ch = (4 * kk + t) ^ ((g & 1) << 2);  // rows g and g + 8 share the swizzle
#pragma unroll
        for (int i = 0; i < ACTIVE; ++i) {
            const uint4 lo = st.x[16 * i + g][ch], hi = st.x[16 * i + g + 8][ch];
#pragma unroll
            for (int j = 0; j < GEMM_NT; ++j) {
                mma_bf16(acc[i][j], lo.x, hi.x, lo.y, hi.y, b[j][0], b[j][1]);
                mma_bf16(acc[i][j], lo.z, hi.z, lo.w, hi.w, b[j][2], b[j][3]);
            }
        }
    }

    // One 32-k step of a narrow warp: the words w[j] (k 8 (t S + kk) .. + 7 of weight row wr[j] + g) times their
    // block scales s2[j] (a bf16 pair) against the first ACTIVE 8-row x tiles, whose chunks t S + kk sit at xoff[i] ^
    // 16 kk of the stage `cur`. The pairs of a word feed the two mma of its n8 tile: (8t', 8t' + 1), (8t' + 2, 8t' + 3)
    // the first, the next two the second (placed: (8t', 8t' + 4), (8t' + 1, 8t' + 5), then (8t' + 2, 8t' + 6),
    // (8t' + 3, 8t' + 7)), and the x pairs are the same k of the chunk.
    template <int ACTIVE>
    static __device__ __forceinline__ void narrow_step(const unsigned char* cur, const unsigned (&xoff)[ACTIVE], int kk,
                                                       const unsigned (&w)[GEMM_NT], const unsigned (&s2)[GEMM_NT],
                                                       const DequantLut& lut, Sums& acc) {
        unsigned b[GEMM_NT][4];
#pragma unroll
        for (int j = 0; j < GEMM_NT; ++j) {
            if constexpr (PLACED)
                dequant_word_placed(w[j], s2[j], b[j]);
            else
                dequant_word(w[j], s2[j], b[j], lut);
        }
#pragma unroll
        for (int i = 0; i < ACTIVE; ++i) {
            const uint4 xv = *reinterpret_cast<const uint4*>(cur + (xoff[i] ^ (16u * kk)));
            unsigned xp[4] = {xv.x, xv.y, xv.z, xv.w};  // the x pairs the weight pairs hold
            if constexpr (PLACED) {
                const unsigned xw[4] = {xv.x, xv.y, xv.z, xv.w};
                pair_halves(xw, xp);  // (k p, k p + 4)
            }
#pragma unroll
            for (int jm = 0; jm < GEMM_NT / 2; ++jm) {
                const unsigned(&p)[4] = b[2 * jm], (&q)[4] = b[2 * jm + 1];
                mma_bf16(acc[i][jm], p[0], q[0], p[1], q[1], xp[0], xp[1]);
                mma_bf16(acc[i][jm], p[2], q[2], p[3], q[3], xp[2], xp[3]);
            }
        }
    }

    // The narrow sums in the wide layout: acc[i][j][2h + c] of lane (g, t) is x row 16 i + 8 h + g against weight
    // row wr[j] + 2t + c, which lane 4 (2t + c) + g / 2 holds as T[2i + h][j / 2][2 (j % 2) + g % 2].
    static __device__ __forceinline__ void widen(const Sums& T, float (&acc)[M_TILES][GEMM_NT][4]) {
        const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
        for (int ix = 0; ix < MT; ++ix)
#pragma unroll
            for (int j = 0; j < GEMM_NT; ++j)
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    const int src = 4 * (2 * t + c) + (g >> 1);
                    const float v0 = __shfl_sync(0xffffffffu, T[ix][j >> 1][2 * (j & 1)], src);
                    const float v1 = __shfl_sync(0xffffffffu, T[ix][j >> 1][2 * (j & 1) + 1], src);
                    acc[ix >> 1][j][2 * (ix & 1) + c] = (g & 1) ? v1 : v0;
                }
    }

    // Tile row n of half h (n in [h BN/2, (h + 1) BN/2)) is weight row n - h BN/2 of wbase[h] /
    // sbase[h]; rows at or past n_valid[h] of a half are zero-filled. x rows come through token_ids
    // (nullptr: the sorted rows themselves).
    __device__ __forceinline__ void run(const bf16_t* x, const int* token_ids, const RowTile& tile,
                                        const unsigned char* const (&wbase)[2], const unsigned char* const (&sbase)[2],
                                        const int (&n_valid)[2], int K, int kblocks, const int (&wr)[GEMM_NT],
                                        int /* m0: 0 */, float (&acc)[M_TILES][GEMM_NT][4]) {
        const unsigned st0 = smem_u32(dyn_smem);
        const unsigned char* const any = reinterpret_cast<const unsigned char*>(x);
        const int tid = threadIdx.x;
        valid = 0u;
#pragma unroll
        for (int i = 0; i < XC; ++i) {
            const int c = tid + i * THREADS, r = c / (BK / 8), ch = c % (BK / 8);
            const bool ok = r < tile.rows;
            const int i_sorted = tile.row0 + r;  // read only for rows of the tile: past them the ids end
            const size_t at = !ok ? 0 : token_ids ? (size_t)token_ids[i_sorted] : (size_t)i_sorted;
            const bf16_t* row = x + at * K;
            xsrc[i] = reinterpret_cast<const unsigned char*>(row + 8 * ch);
            xdst[i] = 16u * (r * (BK / 8) + x_slot(ch, r));
            valid |= (unsigned)ok << i;
        }
#pragma unroll
        for (int i = 0; i < WC; ++i) {
            const int c = tid + i * THREADS, n = c / (BK / 32), h = c % (BK / 32), rn = n % (BN / 2);
            const bool hi = n >= BN / 2;  // selects, not an index: the pointers stay in registers
            const bool ok = rn < (hi ? n_valid[1] : n_valid[0]);
            wsrc[i] = (ok ? (hi ? wbase[1] : wbase[0]) + (size_t)rn * (K >> 1) : any) + 16 * h;
            wdst[i] = W_OFF + 16u * (n * (BK / 32) + w_slot<BK>(n, h));
            valid |= (unsigned)ok << (XC + i);
        }
        {
            const int rn = tid % (BN / 2);
            const bool hi = tid >= BN / 2, ok = rn < (hi ? n_valid[1] : n_valid[0]);
            ssrc = ok ? (hi ? sbase[1] : sbase[0]) + (size_t)rn * (K >> 4) : any;
            valid |= (unsigned)ok << (XC + WC);
        }
#pragma unroll
        for (int s = 0; s < STAGES - 1; ++s) {
            if (s < kblocks) load_stage(st0 + s * (unsigned)sizeof(Stage));
            cp_async_commit();
        }
        if constexpr (NARROW) {
            Sums sums = {};
            k_loop_rows(tile.rows, kblocks, wr, sums);
            widen(sums, acc);
        } else {
            k_loop_rows(tile.rows, kblocks, wr, acc);
        }
    }

    // An expert's last tile pays no mma (nor x reads) for its empty x tiles: the K loop over the smallest power
    // of two of x tiles, up to MT, that covers the tile's `rows` (block-uniform); one loop is built for each.
    __device__ __forceinline__ void k_loop_rows(int rows, int kblocks, const int (&wr)[GEMM_NT], Sums& sums) {
        const int need = (rows + X_TILE - 1) / X_TILE;
        if constexpr (MT > 4) {
            if (need > 4) {
                k_loop<MT>(kblocks, wr, sums);
                return;
            }
        }
        if constexpr (MT > 2) {
            if (need > 2) {
                k_loop<(MT < 4 ? MT : 4)>(kblocks, wr, sums);
                return;
            }
        }
        if constexpr (MT > 1) {
            if (need > 1) {
                k_loop<2>(kblocks, wr, sums);
                return;
            }
        }
        k_loop<1>(kblocks, wr, sums);
    }

    // The K loop over the first ACTIVE x tiles, the prologue's STAGES - 1 stages in flight: wide, into the
    // caller's acc itself; narrow, into the transposed sums.
    template <int ACTIVE>
    __device__ __forceinline__ void k_loop(int kblocks, const int (&wr)[GEMM_NT], Sums& sums) {
        if constexpr (NARROW)
            k_loop_narrow<ACTIVE>(kblocks, wr, sums);
        else
            k_loop_wide<ACTIVE>(kblocks, wr, sums);
    }

    template <int ACTIVE>
    __device__ __forceinline__ void k_loop_wide(int kblocks, const int (&wr)[GEMM_NT], Sums& sums) {
        const Stage* st = reinterpret_cast<const Stage*>(dyn_smem);
        const unsigned st0 = smem_u32(dyn_smem);
        const DequantLut lut = DequantLut::per_thread();  // no copy of a constant word before each lookup
        for (int kb = 0; kb < kblocks; ++kb) {
            next_stage(kb, kblocks, st0);
            const Stage& cur = st[kb % STAGES];
            unsigned sc[GEMM_NT][BK / 32];
            stage_scales(cur, wr, sc);
#pragma unroll
            for (int kk = 0; kk < BK / 32; ++kk) mma_step<ACTIVE>(cur, wr, kk, sc, lut, sums);
        }
        cp_async_wait<0>();
    }

    // The narrow K loop. A lane's offsets inside a stage are fixed for the tile: its S words of each weight row (one
    // 16- or 8-byte read), the scale word holding their S / 2 block scales, and its x chunk of each x tile at step 0.
    template <int ACTIVE>
    __device__ __forceinline__ void k_loop_narrow(int kblocks, const int (&wr)[GEMM_NT], Sums& sums) {
        const unsigned st0 = smem_u32(dyn_smem);
        const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
        unsigned woff[GEMM_NT], soff[GEMM_NT], xoff[ACTIVE];
#pragma unroll
        for (int j = 0; j < GEMM_NT; ++j) {
            const int n = wr[j] + g;
            woff[j] = W_OFF + 16u * (n * S + w_slot<BK>(n, S == 4 ? t : t >> 1)) + (S == 4 ? 0u : 8u * (t & 1));
            soff[j] = S_OFF + 4u * (n * (BK / 64) + (S == 4 ? t >> 1 : 0));
        }
        const int m = (S == 4 ? (t >> 1) << 1 : 0) ^ (g & 1);  // x_slot(t S + kk, 8 i + g) = t S + (kk ^ m)
#pragma unroll
        for (int i = 0; i < ACTIVE; ++i) xoff[i] = 16u * ((8 * i + g) * (BK / 8) + S * t + m);
        // the lane's scale bytes into bytes 1 and 3: groups 2t, 2t + 1 (S = 4: bytes 2 (t & 1), + 1 of word t / 2), or
        // group t twice (S = 2: byte t of the row's word)
        const unsigned a = S == 4 ? 2 * (t & 1) : t, ssel = 0x0404u | (a << 4) | ((S == 4 ? a + 1 : a) << 12);
        // the lookup's scales times 2^112 (e4m3 x 2^-8) from e4m3 x 2^-120; the placed ones e4m3 x 2^118
        const unsigned f = exp2i_bf16x2(112);
        const DequantLut lut = DequantLut::per_thread();  // no copy of a constant word before each lookup
        for (int kb = 0; kb < kblocks; ++kb) {
            next_stage(kb, kblocks, st0);
            const unsigned char* cur = dyn_smem + (kb % STAGES) * sizeof(Stage);
            unsigned w[S][GEMM_NT], sc[GEMM_NT];
#pragma unroll
            for (int j = 0; j < GEMM_NT; ++j) {
                if constexpr (S == 4) {
                    const uint4 v = *reinterpret_cast<const uint4*>(cur + woff[j]);
                    w[0][j] = v.x, w[1][j] = v.y, w[2][j] = v.z, w[3][j] = v.w;
                } else {
                    const uint2 v = *reinterpret_cast<const uint2*>(cur + woff[j]);
                    w[0][j] = v.x, w[1][j] = v.y;
                }
                const unsigned s = prmt(*reinterpret_cast<const unsigned*>(cur + soff[j]), 0u, ssel);
                if constexpr (PLACED)
                    sc[j] = e4m3_pair_placed_x2p118(s);
                else  // exact: a power of two, the result normal
                    sc[j] = fma_bf16x2(e4m3_pair_placed(s), f, 0x80008000u);
            }
#pragma unroll
            for (int kk = 0; kk < S; ++kk) {
                unsigned s2[GEMM_NT];  // S = 4: group 2t at steps 0, 1 and 2t + 1 at 2, 3; S = 2: group t
#pragma unroll
                for (int j = 0; j < GEMM_NT; ++j) s2[j] = S == 4 ? bf16x2_bcast(sc[j], kk >> 1) : sc[j];
                narrow_step<ACTIVE>(cur, xoff, kk, w[kk], s2, lut, sums);
            }
        }
        cp_async_wait<0>();
    }
};
