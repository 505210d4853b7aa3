// The grouped GEMM's wgmma engine (sm_90a): the weights are wgmma's A operand, dequantized straight into its
// register fragments, and the x rows its B operand (the n side) in shared memory. Part of gemm_nvfp4.cu, included
// after gemm_nvfp4_tiled.cuh: it uses TileCopies' copies there, and dequant_word_placed, e4m3_pair_placed and
// bf16x2_bcast from gemm_nvfp4.cu; it holds the staged k order's pass (stage_k64) and column map (staged_column).
//
// Why this orientation: an engine that dequantizes the weight tile into shared memory as bf16 and reads it back
// as wgmma's B (the engine this one replaced) moves 16 KB in and 32 KB out of shared memory a stage of
// 128 x 128 x 64 beside the x rows; here the bf16 weights never touch shared memory, only their packed bytes.
//
// A block: WGS warpgroups (128 WGS threads), 64 WGS weight rows (the fused GLU: 32 WGS gate rows and the same up
// rows) x up to BM (32, 64 or 128) sorted rows of one expert, 64 k a stage. Warpgroup wg's wgmma is
// m64 x n{32, 64, 128} x k16: its row 16 w + g (warp w, lane (g, t)) is tile row r = 32 wg + 8 w + g, its row 16 w + g + 8 is tile row
// 32 WGS + r, so one thread holds the sums of gate row r and up row r for the same x rows (the SwiGLU needs no
// exchange). The n side is the smallest of 32, 64 and 128 that covers the tile's rows (an expert's last tile
// pays no mma for its empty x rows); x rows past the tile's are zero-filled and never stored. More warpgroups
// read each stage of x rows (from L2) for more weight rows: at 4096 rows the x rows are most of a stage's bytes.
//
// The k order: wgmma takes lane (g, t)'s A pairs at positions 16 s + 2 t, + 1 and 16 s + 8 + 2 t, + 1 of k step s
// and reads B (the x rows) in the order shared memory holds it. x arrives in the staged k order (stage_k64, once a
// call before the GEMM): in each 64 k of a row, position 16 s + 8 j + 2 t + e holds k 16 t + 8 j + 4 e + s. Then
// lane t's own 8 bytes of a weight row a stage (k 16 t .. 16 t + 15, one 16-k block scale) dequantized by bit
// placement (dequant_word_placed: word j's pair s = k 16 t + 8 j + s and + 4) are its fragments as they come: no
// gather, no lookup, one scale a row a stage. The products are the lookup's (e2m1 x e4m3 x 2^-8, exact), and the
// fp32 sums run over the same k, in wgmma's order. The gate + up launch writes act in the staged order too
// (act_staged), so the down projection reads it as it is.
//
// Pipeline: STAGES slots of (x rows; packed weights and scales) filled by cp.async, STAGES - 2 stages ahead (the
// weights' and scales' copies prefetch their 128-byte blocks into L2), and one stage's wgmma left in flight across
// the next stage's barrier, so the tensor pipe has the next stage queued while the fragments are made. Stage kb,
// its fragments made: one barrier (everyone's copies of kb and kb + 1 landed; everyone has waited for its wgmma of
// kb - 2, so that slot is refilled now), the 4 wgmma of kb issued, the copies, a wait for the wgmma of kb - 1,
// then the fragments of kb + 1 into the register set that wgmma read, while those of kb run. The two register
// sets alternate by name (the loop is unrolled by the STAGES slots, which also makes every slot's shared memory
// offset a constant): ptxas serializes every wgmma of a kernel in which register arithmetic defines an operand of
// a wgmma in flight (C7513), and with a set known apart from the one in flight it need not.
//
// Accumulators d[4 j + e], n8 tile j of x rows: e = 0, 1: tile row r against x rows 8 j + 2 t, + 1; e = 2, 3:
// tile row 32 WGS + r against the same x rows.
//
// NumPy twin: NumpyBackend.moe_gate_up_act_sorted and moe_gemm_sorted (glm_ep/backend/numpy_backend.py); held
// together by tests/cuda/test_cuda_gemm.py::test_gemm_variants and test_gemm_variants_partial_tiles.
#pragma once

// The staged k order (above): in each 64 k of a row, position 16 s + 8 j + 2 t + e holds k 16 t + 8 j + 4 e + s.
// staged_column(k): where k goes (the gate + up epilogue's act_staged).
__device__ __forceinline__ int staged_column(int k) {
    const int c = k & 63;
    return (k & ~63) | (16 * (c & 3) + 8 * ((c >> 3) & 1) + 2 * (c >> 4) + ((c >> 2) & 1));
}

// out[row] = x[row] in the staged k order, for rows x K (K a multiple of 64): a thread per 16-byte piece of the
// output (8 threads a 64-k block: their loads hit the block's one 128-byte line, their stores are one contiguous
// run), grid-stride. Output word 4 c + i of piece c is positions 16 s + 8 j + 2 t, + 1 with s = c / 2, j = c % 2,
// t = i: the pair (k 16 t + 8 j + s, + 4), half s % 2 of input words 8 t + 4 j + s / 2 and that + 2. NumPy twin:
// glm_ep/backend/cuda/grouped.py's staged_order (tests/cuda/test_cuda_gemm.py::test_stage_k_is_the_staged_order).
extern "C" __global__ void __launch_bounds__(256) stage_k64(const unsigned* __restrict__ x, uint4* __restrict__ out,
                                                           long long pieces) {
    pdl_enter();
    for (long long p = (long long)blockIdx.x * blockDim.x + threadIdx.x; p < pieces;
         p += (long long)gridDim.x * blockDim.x) {
        const int c = (int)(p & 7);
        const unsigned* in = x + 32 * (p >> 3) + 4 * (c & 1) + (c >> 2);
        const unsigned sel = (c & 2) ? 0x7632u : 0x5410u;
        unsigned o[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) o[i] = prmt(in[8 * i], in[8 * i + 2], sel);
        out[p] = make_uint4(o[0], o[1], o[2], o[3]);
    }
}

// A K-major, 128-byte-swizzled operand at shared address addr: rows 128 bytes apart, groups of 8 rows
// 1024 bytes apart (the stride byte offset), the leading byte offset unused (1).
__device__ __forceinline__ u64_t sw128_desc(unsigned addr) {
    return (u64_t)((addr & 0x3ffffu) >> 4) | ((u64_t)1 << 16) | ((u64_t)(1024 >> 4) << 32) | ((u64_t)1 << 62);
}

__device__ __forceinline__ void wgmma_fence() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#endif
}

__device__ __forceinline__ void wgmma_commit() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
#endif
}

template <int N>
__device__ __forceinline__ void wgmma_wait() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
#endif
}

// Generic-proxy writes (cp.async, st.shared) made visible to the async proxy (wgmma's operand reads).
__device__ __forceinline__ void fence_proxy_async() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
}

// d += A (64 x 16 of the warpgroup: this thread's bf16 pairs a) * B (N x 16 x rows, descriptor db): the
// accumulators d[0 .. N / 2), the operands %0 .. %(N / 2 - 1), then a as the next four and db after them.
template <int N>
__device__ __forceinline__ void wgmma_rs(float (&d)[64], const unsigned (&a)[4], u64_t db);

#define WG_D8(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), \
                 "+f"(d[i + 6]), "+f"(d[i + 7])
#define WG_R16_0 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"
#define WG_R16_16 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define WG_R16_32 "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47"
#define WG_R16_48 "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define WGMMA_RS(N, D_REGS, A_DB_REGS, ...)                                                                     \
    template <>                                                                                                 \
    __device__ __forceinline__ void wgmma_rs<N>(float (&d)[64], const unsigned (&a)[4], u64_t db) {            \
        asm volatile("wgmma.mma_async.sync.aligned.m64n" #N "k16.f32.bf16.bf16 {" D_REGS "}, " A_DB_REGS        \
                     ", 1, 1, 1, 0;"                                                                            \
                     : __VA_ARGS__                                                                              \
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));                                    \
    }
#else
#define WGMMA_RS(N, D_REGS, A_DB_REGS, ...)                                                                     \
    template <>                                                                                                 \
    __device__ __forceinline__ void wgmma_rs<N>(float (&)[64], const unsigned (&)[4], u64_t) {                 \
        __trap(); /* sm_90a only: the wrappers never launch it elsewhere */                                     \
    }
#endif
WGMMA_RS(32, WG_R16_0, "{%16, %17, %18, %19}, %20", WG_D8(0), WG_D8(8))
WGMMA_RS(64, WG_R16_0 ", " WG_R16_16, "{%32, %33, %34, %35}, %36", WG_D8(0), WG_D8(8), WG_D8(16), WG_D8(24))
WGMMA_RS(128, WG_R16_0 ", " WG_R16_16 ", " WG_R16_32 ", " WG_R16_48, "{%64, %65, %66, %67}, %68", WG_D8(0),
         WG_D8(8), WG_D8(16), WG_D8(24), WG_D8(32), WG_D8(40), WG_D8(48), WG_D8(56))
#undef WGMMA_RS
#undef WG_D8

template <int BM_, int WGS, int STAGES>
struct GemmWg : TileCopies<BM_, 64 * WGS, 64, 128 * WGS, true> {
    using C = TileCopies<BM_, 64 * WGS, 64, 128 * WGS, true>;
    static constexpr int BM = BM_, BN = 64 * WGS, BK = 64, THREADS = 128 * WGS, K_STEP = BK, HALF = BN / 2;
    static_assert(BM == 32 || BM == 64 || BM == 128, "the n side is n32, n64 or n128");
    static constexpr bool TRANSPOSED = true;  // the sums are d[4 j + e] (above), not the engines' acc
    static constexpr int X_BYTES = C::X_BYTES, W_BYTES = C::W_BYTES, WS_BYTES = W_BYTES + BN * BK / 16;
    // 1024-byte aligned: the x slots (wgmma's 128-byte swizzle), then the packed weights and scales of each slot
    static constexpr int SMEM = STAGES * (X_BYTES + WS_BYTES);
    static_assert(STAGES >= 4 && STAGES % 2 == 0, "the copies run STAGES - 2 stages ahead, the fragments one; a "
                  "round of STAGES stages alternates the two fragment register sets");

    // This thread's tile rows: r and HALF + r.
    static __device__ __forceinline__ int row() {
        return 32 * (threadIdx.x >> 7) + 8 * ((threadIdx.x >> 5) & 3) + ((threadIdx.x & 31) >> 2);
    }

    __device__ __forceinline__ void run(const bf16_t* x, const int* token_ids, const RowTile& tile,
                                        const unsigned char* const (&wbase)[2], const unsigned char* const (&sbase)[2],
                                        const int (&n_valid)[2], int K, int kblocks, float (&d)[64]) {
        this->sources(x, token_ids, tile, wbase, sbase, n_valid, K);
        const unsigned raw = smem_u32(dyn_smem), pad = ((raw + 1023u) & ~1023u) - raw;
        const unsigned xs = raw + pad, ws = xs + STAGES * X_BYTES;
#pragma unroll
        for (int s = 0; s < STAGES - 2; ++s) {
            if (s < kblocks) this->load_split(xs + s * X_BYTES, ws + s * WS_BYTES, x);
            cp_async_commit();
        }
        const unsigned char* wgen = dyn_smem + pad + STAGES * X_BYTES;
        if constexpr (BM > 64)
            if (tile.rows > 64) return k_loop<128>(xs, ws, wgen, kblocks, x, d);  // block-uniform
        if constexpr (BM > 32)
            if (tile.rows > 32) return k_loop<64>(xs, ws, wgen, kblocks, x, d);
        k_loop<32>(xs, ws, wgen, kblocks, x, d);
    }

    // This thread's A fragments of a stage (its packed weights and scales at w): a[s] for k step s of 16. Lane t
    // takes k 16 t .. 16 t + 15 of rows r and HALF + r (one 8-byte read and one block scale each), whose placed
    // pairs (k 16 t + 8 j + s, + 4: word j's pair s) are the fragment's pairs at positions 16 s + 8 j + 2 t in the
    // staged k order x is read in (stage_k64).
    static __device__ __forceinline__ void fragments(const unsigned char* w, int r, unsigned sel,
                                                     unsigned (&a)[BK / 16][4]) {
        const unsigned s0 = *reinterpret_cast<const unsigned*>(w + W_BYTES + 4 * r);
        const unsigned s1 = *reinterpret_cast<const unsigned*>(w + W_BYTES + 4 * (HALF + r));
        const unsigned sp = e4m3_pair_placed_x2p118(prmt(s0, s1, sel));  // rows r and HALF + r
        unsigned b[2][2][4];  // [row][word j][pair s]
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const uint2 v = *reinterpret_cast<const uint2*>(w + 32 * (h * HALF + r) + 8 * (threadIdx.x & 3));
            dequant_word_placed(v.x, bf16x2_bcast(sp, h), b[h][0]);
            dequant_word_placed(v.y, bf16x2_bcast(sp, h), b[h][1]);
        }
#pragma unroll
        for (int s = 0; s < BK / 16; ++s) {
            a[s][0] = b[0][0][s];
            a[s][1] = b[1][0][s];
            a[s][2] = b[0][1][s];
            a[s][3] = b[1][1][s];
        }
    }

    // One stage kb in slot `slot`, its fragments in `a`; the wgmma of kb - 1 (fragments in `b`) may still run. The
    // copies of stage kb + STAGES - 2 go to the slot of kb - 2, whose wgmma every warpgroup has waited for; the
    // fragments of stage kb + 1 go to `b` once the wgmma of kb - 1 is done, while those of kb run.
    template <int N>
    __device__ __forceinline__ void stage(int kb, int kblocks, int slot, unsigned xs, unsigned ws,
                                          const unsigned char* wgen, const bf16_t* x, int r, unsigned sel,
                                          const unsigned (&a)[BK / 16][4], unsigned (&b)[BK / 16][4],
                                          float (&d)[64]) {
        cp_async_wait<STAGES - 4>();  // stages kb and kb + 1 (this thread's copies) ...
        fence_proxy_async();          // ... visible to wgmma ...
        __syncthreads();              // ... everyone's; everyone's wgmma of kb - 2 is done: its slot is free
        const u64_t db = sw128_desc(xs + slot * X_BYTES);
        wgmma_fence();
#pragma unroll
        for (int s = 0; s < BK / 16; ++s) wgmma_rs<N>(d, a[s], db + 2 * s);
        wgmma_commit();
        const int ld = slot >= 2 ? slot - 2 : slot + STAGES - 2;
        if (kb + STAGES - 2 < kblocks) this->load_split(xs + ld * X_BYTES, ws + ld * WS_BYTES, x);
        cp_async_commit();
        wgmma_wait<1>();  // the wgmma of kb - 1, which read b
        if (kb + 1 < kblocks) fragments(wgen + (slot == STAGES - 1 ? 0 : slot + 1) * WS_BYTES, r, sel, b);
    }

    // The K loop with the n side N, in rounds of STAGES stages (stage k0 + i in slot i, a compile-time offset), so
    // that the fragments alternate between two register sets by name: one feeds the wgmma in flight, the other is
    // made for the next stage.
    template <int N>
    __device__ __forceinline__ void k_loop(unsigned xs, unsigned ws, const unsigned char* wgen, int kblocks,
                                           const bf16_t* x, float (&d)[64]) {
        const int r = row(), t = threadIdx.x & 3;
        // the lane's block scales, byte t of the two rows' words, into bytes 1 and 3 (e4m3_pair_placed)
        const unsigned sel = ((unsigned)t << 4) | ((unsigned)(t + 4) << 12);
        unsigned a[BK / 16][4], b[BK / 16][4];
        cp_async_wait<STAGES - 3>();
        __syncthreads();
        fragments(wgen, r, sel, a);
#pragma unroll 1
        for (int k0 = 0; k0 < kblocks; k0 += STAGES) {
#pragma unroll
            for (int i = 0; i < STAGES; i += 2) {
                if (k0 + i >= kblocks) break;
                stage<N>(k0 + i, kblocks, i, xs, ws, wgen, x, r, sel, a, b, d);
                if (k0 + i + 1 >= kblocks) break;
                stage<N>(k0 + i + 1, kblocks, i + 1, xs, ws, wgen, x, r, sel, b, a, d);
            }
        }
        wgmma_wait<0>();
        cp_async_wait<0>();
    }
};
