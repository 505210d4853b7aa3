// The grouped GEMM's tiled engine, which dequantizes each weight tile ONCE into shared memory (mma.sync, a WM x WN
// warp grid), and the copies it shares with the wgmma engine. Part of gemm_nvfp4.cu, included after
// its register engine: it uses GemmStage, RowTile, GEMM_NT, DequantLut, dequant_word and scale_pairs from there, and
// common.cuh, nvfp4_mma.cuh and async_copy.cuh (glm_ep/backend/cuda/kernel_loader.py inlines them all).
//
// NumPy twin: NumpyBackend.moe_gate_up_act_sorted and moe_gemm_sorted (glm_ep/backend/numpy_backend.py); held
// together by tests/cuda/test_cuda_gemm.py::test_gemm_variants and test_gemm_variants_partial_tiles.
#pragma once

// ---- The tiled engine: a WM x WN warp grid over a BM x BN tile (WM > 1) ----------------------------
// Several warps share each weight row, so the weight tile is dequantized ONCE per stage into shared
// memory as bf16 (every thread a 16-byte piece: 32 nibbles, two block scales) and every warp reads its
// fragments of both operands with ldmatrix. A warp covers MT m16 tiles of x rows (from m0) and the
// same 4 n8 tiles of weight rows as the register engine. The dequantization of stage kb + 1 and the
// mma of stage kb run between the same two barriers (double-buffered bf16 tile), so a k block costs
// one __syncthreads. In shared memory, 16-byte chunk c of a 128-byte row r (x rows and dequantized
// weight rows alike) sits at c ^ (r & 7): the 8 rows an ldmatrix reads hit 8 disjoint bank groups.

__device__ __forceinline__ void ldsm_x4(unsigned addr, unsigned (&r)[4]) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

// The copies and the dequantization of a BM x BN tile by THREADS threads (the tiled engine; the wgmma engine takes
// the copies only). PF: the weight and scale copies prefetch their 128-byte blocks into L2 (as the register
// engine's do).
template <int BM, int BN, int BK, int THREADS, bool PF = false>
struct TileCopies {
    static constexpr int CH = BK / 8, ROW = 2 * BK;   // 16-byte chunks and bytes of an x row / a bf16 weight row
    static constexpr int XC = BM * CH / THREADS;       // x copies per thread and stage
    static constexpr int PIECES = BN * BK / 32;        // 16-byte weight pieces per stage
    static constexpr int WP = PIECES / THREADS;        // ... per thread
    // a stage: x rows, then the packed weights (unswizzled), then the scales; then the two bf16 tiles
    static constexpr int X_BYTES = BM * ROW, W_BYTES = BN * BK / 2, STAGE = X_BYTES + W_BYTES + BN * BK / 16;
    static constexpr int DEQ = BN * ROW;
    static constexpr bool TRANSPOSED = false;  // the engines on these copies leave their sums in acc
    static_assert(XC * THREADS == BM * CH && WP >= 1 && WP * THREADS == PIECES, "copies and pieces split evenly");
    static_assert(CH >= 8 && (THREADS / CH) % 8 == 0, "the swizzle needs 8 chunks a row; a thread's x copies "
                  "share one swizzle");
    static_assert(BN <= THREADS, "one scale row a thread");
    static_assert(STAGE == sizeof(GemmStage<BM, BN, BK>), "the loader sizes the stages as GemmStage");

    // This thread's copies; every source stays a valid address (zero-filled copies read row 0) and moves
    // one stage along per load.
    unsigned xoff[XC];              // element offset in x of the chunk each x copy takes
    unsigned xvalid;                // bit i: x copy i reads a row of the tile
    const unsigned char* wsrc[WP];  // each weight piece
    unsigned wvalid;
    const unsigned char* ssrc;      // threads < BN: their row's scales
    bool svalid;

    __device__ __forceinline__ void load_stage(unsigned stage, const bf16_t* x) {
        load_split(stage, stage + X_BYTES, x);
    }

    // x rows to xst, packed weights then scales to wst (the wgmma engine keeps them apart)
    __device__ __forceinline__ void load_split(unsigned xst, unsigned wst, const bf16_t* x) {
        const int tid = threadIdx.x, r = tid / CH, ch = tid % CH;
        const unsigned xdst = xst + r * ROW + 16 * (ch ^ (r & 7));  // + i THREADS / CH rows: the same swizzle
#pragma unroll
        for (int i = 0; i < XC; ++i) {
            cp_async16_zfill(xdst + i * (THREADS / CH) * ROW, x + xoff[i], (xvalid >> i) & 1u);
            xoff[i] += BK;
        }
#pragma unroll
        for (int i = 0; i < WP; ++i) {
            cp_async_zfill<16, PF>(wst + 16 * (tid + i * THREADS), wsrc[i], (wvalid >> i) & 1u);
            wsrc[i] += BK / 2;
        }
        if (tid < BN) {
            cp_async_zfill<BK / 16, PF>(wst + W_BYTES + tid * (BK / 16), ssrc, svalid);
            ssrc += BK / 16;
        }
    }

    // This thread's pieces of a stage's packed weights -> the bf16 tile: piece (n, h) is k 32h .. 32h + 31
    // of weight row n (two block scales), 4 chunks of 8 k.
    static __device__ __forceinline__ void dequant(const unsigned char* stage, unsigned char* dq) {
        dequant_split(stage + X_BYTES, dq);
    }

    // the same from packed weights at w (their scales at w + W_BYTES)
    static __device__ __forceinline__ void dequant_split(const unsigned char* w, unsigned char* dq) {
        const DequantLut lut = DequantLut::per_thread();
#pragma unroll
        for (int i = 0; i < WP; ++i) {
            const int c = threadIdx.x + i * THREADS, n = c / (BK / 32), h = c % (BK / 32);
            const uint4 q = *reinterpret_cast<const uint4*>(w + 16 * c);
            const unsigned sw = *reinterpret_cast<const unsigned short*>(w + W_BYTES + n * (BK / 16) + 2 * h);
            unsigned sp[2];
            scale_pairs(sw, sp);
            const unsigned words[4] = {q.x, q.y, q.z, q.w};
            const int d0 = n * ROW + 16 * ((4 * h) ^ (n & 7));  // chunk 4h + j at d0 ^ 16 j
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                unsigned b[4];
                dequant_word(words[j], sp[j >> 1], b, lut);
                *reinterpret_cast<uint4*>(dq + (d0 ^ (16 * j))) = make_uint4(b[0], b[1], b[2], b[3]);
            }
        }
    }


    // Where this thread's copies come from: tile rows through token_ids (nullptr: the sorted rows), weight
    // row n of half h of the tile from wbase[h] / sbase[h], rows at or past n_valid[h] zero-filled.
    __device__ __forceinline__ void sources(const bf16_t* x, const int* token_ids, const RowTile& tile,
                                            const unsigned char* const (&wbase)[2],
                                            const unsigned char* const (&sbase)[2], const int (&n_valid)[2], int K) {
        const int tid = threadIdx.x;
        xvalid = 0;
#pragma unroll
        for (int i = 0; i < XC; ++i) {
            const int r = (tid + i * THREADS) / CH, ch = tid % CH;
            const bool ok = r < tile.rows;
            const int row = ok ? (token_ids ? token_ids[tile.row0 + r] : tile.row0 + r) : 0;
            xoff[i] = (unsigned)row * (unsigned)K + 8 * ch;
            xvalid |= (unsigned)ok << i;
        }
        wvalid = 0;
#pragma unroll
        for (int i = 0; i < WP; ++i) {
            const int c = tid + i * THREADS, n = c / (BK / 32) % BN, h = c % (BK / 32), rn = n % (BN / 2);
            const bool hi = n >= BN / 2, ok = rn < (hi ? n_valid[1] : n_valid[0]);
            wsrc[i] = (ok ? (hi ? wbase[1] : wbase[0]) + (size_t)rn * (K >> 1) : wbase[0]) + 16 * h;
            wvalid |= (unsigned)ok << i;
        }
        {
            const int rn = tid % (BN / 2);
            const bool hi = tid % BN >= BN / 2;
            svalid = tid < BN && rn < (hi ? n_valid[1] : n_valid[0]);
            ssrc = svalid ? (hi ? sbase[1] : sbase[0]) + (size_t)rn * (K >> 4) : sbase[0];
        }
    }
};

template <int MT, int WM, int WN, int BK, int STAGES>
struct GemmTiled : TileCopies<16 * MT * WM, 32 * WN, BK, 32 * WM * WN> {
    using C = TileCopies<16 * MT * WM, 32 * WN, BK, 32 * WM * WN>;
    static constexpr int BM = 16 * MT * WM, BN = 32 * WN, THREADS = 32 * WM * WN, WARP_COLS = WN, M_TILES = MT,
                         N_TILES = GEMM_NT, M_STRIDE = 16, M0_STEP = 16 * MT, K_STEP = BK;
    static constexpr int ROW = C::ROW, STAGE = C::STAGE, DEQ = C::DEQ;
    static_assert(WM > 1 && STAGES >= 3, "a warp grid; the dequantization runs a stage ahead");

    // One stage of a warp: MT m16 tiles of x rows against its 4 n8 tiles. a_off / b_off[p]: the lane's
    // ldmatrix row and chunk at k step 0 (pairs of n8 tiles are adjacent rows, one ldmatrix for both);
    // chunk 2 kk + b of row r lies at (2 kk + b) ^ (r & 7) = 2 kk ^ (b ^ (r & 7)), so step kk is an XOR.
    static __device__ __forceinline__ void mma_stage(unsigned xs, unsigned dq, unsigned a_off,
                                                     const unsigned (&b_off)[GEMM_NT / 2],
                                                     float (&acc)[MT][GEMM_NT][4]) {
#pragma unroll
        for (int kk = 0; kk < BK / 16; ++kk) {
            unsigned b[GEMM_NT / 2][4];  // pair p: (b0, b1) of n8 tile 2p, then of 2p + 1
#pragma unroll
            for (int p = 0; p < GEMM_NT / 2; ++p) ldsm_x4(dq + (b_off[p] ^ (32 * kk)), b[p]);
#pragma unroll
            for (int i = 0; i < MT; ++i) {
                unsigned a[4];
                ldsm_x4(xs + (a_off ^ (32 * kk)) + i * 16 * ROW, a);
#pragma unroll
                for (int j = 0; j < GEMM_NT; ++j)
                    mma_bf16(acc[i][j], a[0], a[1], a[2], a[3], b[j >> 1][2 * (j & 1)], b[j >> 1][2 * (j & 1) + 1]);
            }
        }
    }

    __device__ __forceinline__ void run(const bf16_t* x, const int* token_ids, const RowTile& tile,
                                        const unsigned char* const (&wbase)[2], const unsigned char* const (&sbase)[2],
                                        const int (&n_valid)[2], int K, int kblocks, const int (&wr)[GEMM_NT],
                                        int m0, float (&acc)[MT][GEMM_NT][4]) {
        const int lane = threadIdx.x & 31;
        this->sources(x, token_ids, tile, wbase, sbase, n_valid, K);
        const unsigned a_off = (m0 + (lane & 15)) * ROW + 16 * ((lane >> 4) ^ (lane & 7));
        unsigned b_off[GEMM_NT / 2];
#pragma unroll
        for (int p = 0; p < GEMM_NT / 2; ++p)
            b_off[p] = (wr[2 * p] + (lane & 7) + ((lane >> 4) << 3)) * ROW + 16 * (((lane >> 3) & 1) ^ (lane & 7));
        const unsigned smem = smem_u32(dyn_smem), deq = smem + STAGES * STAGE;
#pragma unroll
        for (int s = 0; s < STAGES - 1; ++s) {
            if (s < kblocks) this->load_stage(smem + s * STAGE, x);
            cp_async_commit();
        }
        cp_async_wait<STAGES - 2>();  // stage 0
        __syncthreads();
        C::dequant(dyn_smem, dyn_smem + STAGES * STAGE);
        int cur = 0;  // the stage of k block kb
        for (int kb = 0; kb < kblocks; ++kb) {
            cp_async_wait<STAGES - 3>();  // stage kb + 1 has landed (this thread's copies) ...
            __syncthreads();  // ... everyone's; tile kb is dequantized; stage kb - 1 and tile kb - 1 are free
            const int nxt = cur + 1 == STAGES ? 0 : cur + 1, prev = cur == 0 ? STAGES - 1 : cur - 1;
            if (kb + STAGES - 1 < kblocks) this->load_stage(smem + prev * STAGE, x);  // stage kb + STAGES - 1
            cp_async_commit();
            if (kb + 1 < kblocks) C::dequant(dyn_smem + nxt * STAGE, dyn_smem + STAGES * STAGE + ((kb + 1) & 1) * DEQ);
            mma_stage(smem + cur * STAGE, deq + (kb & 1) * DEQ, a_off, b_off, acc);
            cur = nxt;
        }
        cp_async_wait<0>();
    }
};
