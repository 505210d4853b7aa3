// The grouped GEMM's entry points and the macros that instantiate them, one per engine: GEMM_ENTRIES (the two
// entries of an engine) and GEMM_VARIANT / GEMM_NARROW / GEMM_PLACED / GEMM_TILED / GEMM_WGMMA (a shipped
// variant), GEMM_NARROW_OF / GEMM_WGMMA_OF (the same with an entry suffix: the stage sweep's build). Part of
// gemm_nvfp4.cu, included after its engines and its gemm_sorted / gemm_sorted_glu drivers
// (glm_ep/backend/cuda/kernel_loader.py inlines it).
//
// NumPy twin: NumpyBackend.moe_gate_up_act_sorted and moe_gemm_sorted (glm_ep/backend/numpy_backend.py); held
// together by tests/cuda/test_cuda_gemm.py (every variant, the stage sweep's among them) and
// tests/cuda/test_kernels_build.py (the instantiated variants against the loader's GEMM_VARIANTS).
#pragma once

// The entry points of engine G (THREADS threads): nvfp4_gemm_sorted[_glu]_SUFFIX.
#define GEMM_ENTRIES(SUFFIX, G, THREADS, MIN_BLOCKS)                                                            \
    extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS) nvfp4_gemm_sorted_##SUFFIX(                \
        const bf16_t* __restrict__ x, const int* __restrict__ sorted_token_ids,                                  \
        const int* __restrict__ expert_offsets, const u64_t* __restrict__ packed_ptrs,                           \
        const u64_t* __restrict__ scale_ptrs, const float* __restrict__ scale2, int start, int count,             \
        bf16_t* __restrict__ out, int N, int K, int n_blocks, float* __restrict__ partials, int slots) {         \
        pdl_enter();                                                                                              \
        gemm_sorted<G>(x, sorted_token_ids, expert_offsets, packed_ptrs, scale_ptrs, scale2, start, count, out,   \
                       N, K, n_blocks, partials, slots);                                                          \
    }                                                                                                             \
    extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS) nvfp4_gemm_sorted_glu_##SUFFIX(            \
        const bf16_t* __restrict__ x, const int* __restrict__ sorted_token_ids,                                  \
        const int* __restrict__ expert_offsets, const u64_t* __restrict__ gate_packed,                           \
        const u64_t* __restrict__ gate_scale, const float* __restrict__ gate_scale2,                              \
        const u64_t* __restrict__ up_packed, const u64_t* __restrict__ up_scale,                                 \
        const float* __restrict__ up_scale2, int start, int count, bf16_t* __restrict__ act, int N, int K,        \
        int n_blocks, float limit, float* __restrict__ partials, int slots, int act_staged) {                    \
        pdl_enter();                                                                                              \
        gemm_sorted_glu<G>(x, sorted_token_ids, expert_offsets, gate_packed, gate_scale, gate_scale2, up_packed, \
                           up_scale, up_scale2, start, count, act, N, K, n_blocks, limit, partials, slots,        \
                           act_staged);                                                                           \
    }

// The variants, (BM, WM, WN, BK, STAGES, mma) in glm_ep/backend/cuda/kernel_loader.py's GEMM_VARIANTS; each one's
// shared memory is the loader's GEMM_SMEM_ + its entry suffix in upper case.
// Register engine (WM = 1, MT = BM / 16): nvfp4_gemm_sorted[_glu]_m{BM}w{WN}k{BK}.
#define GEMM_VARIANT(BM, MT, WARPS, BK, STAGES, MIN_BLOCKS)                                                      \
    typedef Gemm<MT, WARPS, BK, STAGES> Gemm_m##BM##w##WARPS##k##BK;                                             \
    static_assert(BM == 16 * MT && STAGES * sizeof(GemmStage<BM, 32 * WARPS, BK>) == GEMM_SMEM_M##BM##W##WARPS##K##BK, \
                  "a variant differs from GEMM_VARIANTS in glm_ep/backend/cuda/kernel_loader.py");                      \
    GEMM_ENTRIES(m##BM##w##WARPS##k##BK, Gemm_m##BM##w##WARPS##k##BK, 32 * WARPS, MIN_BLOCKS)

// Register engine, narrow (x rows as the mma's n8 side, MT = BM / 8), the lookup (GEMM_NARROW,
// nvfp4_gemm_sorted[_glu]_m{BM}w{WN}k{BK}n) or the placed dequantization (GEMM_PLACED, dequant_word_placed,
// ..._m{BM}w{WN}k{BK}p); TAG / UTAG: the suffix's closing letter in lower / upper case; SUF / USUF: what the stage
// sweep's builds add to it (GEMM_SWEEP, below; empty in the shipped build).
#define GEMM_NARROW_OF(BM, MT, WARPS, BK, STAGES, MIN_BLOCKS, PLACED, TAG, UTAG, SUF, USUF)                       \
    typedef Gemm<MT, WARPS, BK, STAGES, true, PLACED> Gemm_m##BM##w##WARPS##k##BK##TAG##SUF;                     \
    static_assert(BM == 8 * MT && STAGES * sizeof(GemmStage<BM, 32 * WARPS, BK>) ==                               \
                                      GEMM_SMEM_M##BM##W##WARPS##K##BK##UTAG##USUF,                              \
                  "a variant differs from GEMM_VARIANTS in glm_ep/backend/cuda/kernel_loader.py");                      \
    GEMM_ENTRIES(m##BM##w##WARPS##k##BK##TAG##SUF, Gemm_m##BM##w##WARPS##k##BK##TAG##SUF, 32 * WARPS, MIN_BLOCKS)
#define GEMM_NARROW(BM, MT, WARPS, BK, STAGES, MIN_BLOCKS) \
    GEMM_NARROW_OF(BM, MT, WARPS, BK, STAGES, MIN_BLOCKS, false, n, N, , )
#define GEMM_PLACED(BM, MT, WARPS, BK, STAGES, MIN_BLOCKS) \
    GEMM_NARROW_OF(BM, MT, WARPS, BK, STAGES, MIN_BLOCKS, true, p, P, , )

// Tiled engine (WM > 1, MT = BM / (16 WM)): nvfp4_gemm_sorted[_glu]_m{BM}w{WM}x{WN}k{BK}.
#define GEMM_TILED(BM, MT, WM, WN, BK, STAGES, MIN_BLOCKS)                                                      \
    typedef GemmTiled<MT, WM, WN, BK, STAGES> Gemm_m##BM##w##WM##x##WN##k##BK;                                  \
    static_assert(BM == 16 * MT * WM && STAGES * sizeof(GemmStage<BM, 32 * WN, BK>) +                            \
                                            sizeof(uint4[2][32 * WN][BK / 8]) == GEMM_SMEM_M##BM##W##WM##X##WN##K##BK, \
                  "a variant differs from GEMM_VARIANTS in glm_ep/backend/cuda/kernel_loader.py");                      \
    GEMM_ENTRIES(m##BM##w##WM##x##WN##k##BK, Gemm_m##BM##w##WM##x##WN##k##BK, 32 * WM * WN, MIN_BLOCKS)

// wgmma engine (sm_90a; the weights as wgmma's A operand in registers, WN / 2 warpgroups of 64 weight rows each:
// 32 WN weight rows x up to BM rows): nvfp4_gemm_sorted[_glu]_m{BM}wg{WN}k64.
#define GEMM_WGMMA_OF(BM, WN, STAGES, MIN_BLOCKS, SUF, USUF)                                                     \
    typedef GemmWg<BM, WN / 2, STAGES> Gemm_m##BM##wg##WN##k64##SUF;                                             \
    static_assert(Gemm_m##BM##wg##WN##k64##SUF::SMEM + 1024 == GEMM_SMEM_M##BM##WG##WN##K64##USUF,               \
                  "a variant differs from GEMM_VARIANTS in glm_ep/backend/cuda/kernel_loader.py");                      \
    GEMM_ENTRIES(m##BM##wg##WN##k64##SUF, Gemm_m##BM##wg##WN##k64##SUF, 64 * WN, MIN_BLOCKS)
#define GEMM_WGMMA(BM, WN, STAGES, MIN_BLOCKS) GEMM_WGMMA_OF(BM, WN, STAGES, MIN_BLOCKS, , )
