// The grouped GEMM's register-operand wgmma engine (sm_90a). Part of gemm_nvfp4.cu, included after its
// other engines and TileSources: it uses TileCopies, DequantLut, dequant_word, scale_pairs, sw128_desc and
// the wgmma fences from there (glm_ep/backend/cuda/loader.py inlines the includes).
//
// The weights are wgmma's A operand, in registers, and the x rows its B operand, from shared memory, so a
// block computes the tile transposed: D[weight row][x row]. Each of the block's two warpgroups issues
// m64nNk16 over 64 weight rows and all of the tile's x rows (N = 128, or 64 for a tile of at most 64 rows).
// Each thread dequantizes exactly the A fragment it supplies, from the packed stage straight into
// registers: no bf16 weight tile in shared memory, no barrier between the dequantization and the mma,
// every weight of the tile dequantized once. Lane (g, t) of a warp supplies its fragment rows g and g + 8
// (tile rows ra and rb) at k 2t, 2t + 1 and 2t + 8, 2t + 9 of each 16-k step, i.e. byte t of every 8-k
// word of those rows (three PRMT gather a row's bytes t of four words into one word for dequant_word).
// Fragment rows: for one projection, rows 16 w + g and + 8 of the block's 128 (w the warp); for the fused
// GLU, gate row 8 w + g and the same up row, so each thread holds a gate and its up for the SwiGLU.
// The output tile is transposed back through shared memory (where the stages were) and stored in 16-byte
// pieces of a row.
//
// Pipeline: STAGES slots of (x rows, packed weights, scales); k block j's copies are issued STAGES - 2
// blocks ahead into slot j % STAGES. Iteration kb waits for block kb and passes one barrier, after which
// every warpgroup's wgmma of kb - 2 is done (each waited for it in iteration kb - 1), so slot
// (kb - 2) % STAGES takes block kb + STAGES - 2; it then dequantizes kb into one of two A register sets
// (alternating), issues the wgmma and leaves it in flight into the next iteration. The other set is read
// (XORed into a sink) after each wgmma.wait_group, so ptxas keeps the two sets apart; with one set it reuses
// the registers of the wgmma in flight and injects a warpgroup.arrive before the next dequantization.

// d += A (64 weight rows x 16 k: a[0..3] per thread, mma.sync's A fragment of the warp's 16 rows) * B (N x
// rows x 16 k, K-major by descriptor db), bf16 operands, fp32 accumulators: N = 128 (d[0 .. 63]) ...
__device__ __forceinline__ void wgmma_rs_n128(float (&d)[64], const unsigned (&a)[4], u64_t db) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, "
        "%21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, "
        "%40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, "
        "%59, %60, %61, %62, %63 "
        "}, {%64, %65, %66, %67}, %68, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
#else
    __trap();  // sm_90a only: the wrappers never launch it elsewhere
#endif
}

// ... N = 64 (d[0 .. 31]: x rows 0 .. 63)
__device__ __forceinline__ void wgmma_rs_n64(float (&d)[64], const unsigned (&a)[4], u64_t db) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, "
        "%21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31 "
        "}, {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
#else
    __trap();
#endif
}

// Byte t of each of a 16-byte piece's four words (sel = t | (t + 4) << 4), as one word.
__device__ __forceinline__ unsigned gather_bytes(const uint4& q, unsigned sel) {
    return prmt(prmt(q.x, q.y, sel), prmt(q.z, q.w, sel), 0x5410u);
}

template <int BN_, int BK, int STAGES>
struct GemmWgRs : TileCopies<128, BN_, BK, 2 * BN_, true> {
    using C = TileCopies<128, BN_, BK, 2 * BN_, true>;
    static constexpr int BM = 128, BN = BN_, THREADS = 2 * BN_;  // a warpgroup per 64 weight rows
    static constexpr int X_BYTES = C::X_BYTES, W_BYTES = C::W_BYTES, W_SLOT = W_BYTES + BN * BK / 16;
    static constexpr int SMEM = STAGES * (X_BYTES + W_SLOT);  // the x slots (1024-aligned), then the w slots
    static_assert(BK == 64 && STAGES >= 3, "a k block is 4 wgmma of 16 k from two 16-byte pieces a row; the "
                  "copies run STAGES - 2 blocks ahead");
    static_assert(BM * (2 * BN + 16) <= SMEM, "the output tile is staged where the stages were");

    // This thread's A registers of a k block (a[kk]: 16-k step kk) from the packed weights and scales at w:
    // tile rows ra (fragment row g) and rb (g + 8), byte t of each word (sel).
    static __device__ __forceinline__ void dequant_rows(const unsigned char* w, int ra, int rb, unsigned sel,
                                                        const DequantLut& lut, unsigned (&a)[BK / 16][4]) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int n = r ? rb : ra, sw = (n >> 2) & 1;  // piece h of row n at h ^ sw (piece_slot)
            const uint4 q[2] = {*reinterpret_cast<const uint4*>(w + 32 * n + 16 * sw),         // k 0 .. 31
                                *reinterpret_cast<const uint4*>(w + 32 * n + 16 * (sw ^ 1))};  // k 32 .. 63
            const unsigned s = *reinterpret_cast<const unsigned*>(w + W_BYTES + 4 * n);  // the 4 block scales
#pragma unroll
            for (int p = 0; p < 2; ++p) {  // byte j of the gathered word: 8-k chunk 4p + j, k 2t and 2t + 1
                unsigned sp[2], b[4];
                scale_pairs(s >> (16 * p), sp);  // 16-k blocks 2p and 2p + 1
                dequant_word(gather_bytes(q[p], sel), sp[0], sp[1], b, lut);
                a[2 * p][r] = b[0], a[2 * p][2 + r] = b[1];  // step 2p: chunk 4p (k 2t ..), 4p + 1 (k 2t + 8 ..)
                a[2 * p + 1][r] = b[2], a[2 * p + 1][2 + r] = b[3];
            }
        }
    }

    // The k loop: d[4 j + c] = D[ra][8 j + 2 t + c], d[4 j + 2 + c] = D[rb][...] (x rows of the tile), with
    // D = (dequantized weights as e2m1 x e4m3 x 2^-8) x^T in fp32.
    __device__ __forceinline__ void run(const bf16_t* x, const int* token_ids, const TileSources& src, int K, int ra,
                                        int rb, float (&d)[64]) {
        this->sources(x, token_ids, src.tile, src.wb, src.sb, src.valid, K);
        const unsigned raw = smem_u32(dyn_smem), pad = ((raw + 1023u) & ~1023u) - raw;
        const unsigned xs = raw + pad, ws = xs + STAGES * X_BYTES;
        const unsigned char* wgen = dyn_smem + pad + STAGES * X_BYTES;  // the w slots, generic
        const unsigned t = threadIdx.x & 3, sel = t | (t + 4) << 4;
        const DequantLut lut = DequantLut::per_thread();
        const int kblocks = K / BK;
        const bool upper = src.tile.rows > 64;  // block-uniform: at most 64 rows take the N = 64 wgmma
#pragma unroll
        for (int s = 0; s < STAGES - 2; ++s) {
            if (s < kblocks) this->load_split(xs + s * X_BYTES, ws + s * W_SLOT, x);
            cp_async_commit();
        }
        int cur = 0, ld = STAGES - 2;  // the slots of block kb and of kb + STAGES - 2
        unsigned sink = 0;
        auto block = [&](int kb, unsigned (&a)[BK / 16][4], unsigned (&other)[BK / 16][4]) {
            cp_async_wait<STAGES - 3>();  // block kb (this thread's copies) ...
            fence_proxy_async();          // ... visible to wgmma ...
            __syncthreads();              // ... everyone's; every wgmma of kb - 2 is done
            if (kb + STAGES - 2 < kblocks) this->load_split(xs + ld * X_BYTES, ws + ld * W_SLOT, x);
            cp_async_commit();
            dequant_rows(wgen + cur * W_SLOT, ra, rb, sel, lut, a);
            const u64_t db = sw128_desc(xs + cur * X_BYTES);
            wgmma_fence();
            if (upper) {
#pragma unroll
                for (int kk = 0; kk < BK / 16; ++kk) wgmma_rs_n128(d, a[kk], db + 2 * kk);
            } else {
#pragma unroll
                for (int kk = 0; kk < BK / 16; ++kk) wgmma_rs_n64(d, a[kk], db + 2 * kk);
            }
            wgmma_commit();
            wgmma_wait<1>();  // k block kb - 1's wgmma is done: its A registers are free
#pragma unroll
            for (int i = 0; i < BK / 16; ++i) sink ^= other[i][0] ^ other[i][1] ^ other[i][2] ^ other[i][3];
            cur = cur == STAGES - 1 ? 0 : cur + 1, ld = ld == STAGES - 1 ? 0 : ld + 1;
        };
        unsigned a0[BK / 16][4] = {}, a1[BK / 16][4] = {};
        for (int kb = 0; kb < kblocks; kb += 2) {
            block(kb, a0, a1);
            if (kb + 1 < kblocks) block(kb + 1, a1, a0);
        }
        if (K < 0) d[0] = __uint_as_float(sink);
        wgmma_wait<0>();
        cp_async_wait<0>();
        __syncthreads();  // every warpgroup is done with the stages: the output tile may be staged there
    }

    // Where the output tile is staged: x row r, column c (bf16) at r * (2 COLS + 16) + 2 c from here (the
    // stages' 1024-aligned start; the 16 bytes of padding put a warp's 4 x rows on distinct banks).
    static __device__ __forceinline__ unsigned char* staging() {
        const unsigned raw = smem_u32(dyn_smem);
        return dyn_smem + (((raw + 1023u) & ~1023u) - raw);
    }

    // The staged tile's rows < tile.rows, columns < N - n0, to out rows tile.row0 + r at column n0 (16 bytes a
    // thread and step; N and n0 are multiples of 8).
    template <int COLS>
    static __device__ __forceinline__ void store_staged(const unsigned char* stg, const RowTile& tile, bf16_t* out,
                                                        int N, int n0) {
        constexpr int PITCH = 2 * COLS + 16, CH = COLS / 8;
        __syncthreads();  // every thread's columns are staged
        for (int i = threadIdx.x; i < BM * CH; i += THREADS) {
            const int r = i / CH, c = 8 * (i % CH);
            if (r < tile.rows && n0 + c < N)
                *reinterpret_cast<uint4*>(out + (size_t)(tile.row0 + r) * N + n0 + c) =
                    *reinterpret_cast<const uint4*>(stg + r * PITCH + 2 * c);
        }
    }
};

// gemm_sorted and gemm_sorted_glu on the register-operand wgmma engine G (their arguments and results).
template <class G>
__device__ __forceinline__ void gemm_sorted_rs(const bf16_t* __restrict__ x, const int* __restrict__ sorted_token_ids,
                                               const int* __restrict__ expert_offsets,
                                               const u64_t* __restrict__ packed_ptrs,
                                               const u64_t* __restrict__ scale_ptrs, const float* __restrict__ scale2,
                                               int start, int count, bf16_t* __restrict__ out, int N, int K,
                                               int n_blocks) {
    const TileSources src = TileSources::proj<G::BM, G::BN>(expert_offsets, start, count, n_blocks, packed_ptrs,
                                                            scale_ptrs, N, K);
    if (src.tile.e < 0) return;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int ra = 16 * warp + g, rb = ra + 8;
    float d[64] = {};
    G gemm;
    gemm.run(x, sorted_token_ids, src, K, ra, rb, d);
    const float f = scale2[src.tile.e] * 256.0f;
    constexpr int PITCH = 2 * G::BN + 16;
    unsigned char* stg = G::staging();
#pragma unroll
    for (int j = 0; j < 16; ++j)
#pragma unroll
        for (int c = 0; c < 2; ++c) {
            unsigned char* row = stg + (8 * j + 2 * t + c) * PITCH;
            *reinterpret_cast<bf16_t*>(row + 2 * ra) = f32_to_bf16(d[4 * j + c] * f);
            *reinterpret_cast<bf16_t*>(row + 2 * rb) = f32_to_bf16(d[4 * j + 2 + c] * f);
        }
    G::template store_staged<G::BN>(stg, src.tile, out, N, src.n0);
}

template <class G>
__device__ __forceinline__ void gemm_sorted_glu_rs(const bf16_t* __restrict__ x,
                                                   const int* __restrict__ sorted_token_ids,
                                                   const int* __restrict__ expert_offsets,
                                                   const u64_t* __restrict__ gate_packed,
                                                   const u64_t* __restrict__ gate_scale,
                                                   const float* __restrict__ gate_scale2,
                                                   const u64_t* __restrict__ up_packed,
                                                   const u64_t* __restrict__ up_scale,
                                                   const float* __restrict__ up_scale2, int start, int count,
                                                   bf16_t* __restrict__ act, int N, int K, int n_blocks, float limit) {
    const TileSources src = TileSources::glu<G::BM, G::BN>(expert_offsets, start, count, n_blocks, gate_packed,
                                                           gate_scale, up_packed, up_scale, N, K);
    if (src.tile.e < 0) return;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int col = 8 * warp + g, ra = col, rb = G::BN / 2 + col;  // gate row col, and its up row
    float d[64] = {};
    G gemm;
    gemm.run(x, sorted_token_ids, src, K, ra, rb, d);
    const float fg = gate_scale2[src.tile.e] * 256.0f, fu = up_scale2[src.tile.e] * 256.0f;
    constexpr int COLS = G::BN / 2, PITCH = 2 * COLS + 16;
    unsigned char* stg = G::staging();
#pragma unroll
    for (int j = 0; j < 16; ++j)
#pragma unroll
        for (int c = 0; c < 2; ++c) {
            const float gv = round_bf16(d[4 * j + c] * fg), uv = round_bf16(d[4 * j + 2 + c] * fu);
            *reinterpret_cast<bf16_t*>(stg + (8 * j + 2 * t + c) * PITCH + 2 * col) = swiglu_one(gv, uv, limit);
        }
    G::template store_staged<COLS>(stg, src.tile, act, N, src.n0);
}
