// The NVFP4 x bf16 tensor-core step shared by the NVFP4 GEMV kernels (gemv_nvfp4.cu,
// gemv_nvfp4_ring.cu): exact dequantization of a 16-byte chunk of 32 e2m1 nibbles to bf16 pairs and
// the mma.sync m16n8k16 (bf16 operands, fp32 accumulators) that consumes them. Include after
// common.cuh (glm_ep/backend/cuda/kernel_loader.py inlines both; neither includes the other).
//
// NumPy twin: glm_ep/checkpoint/nvfp4.py's dequantize, through NumpyBackend.moe_gemv and its kin; held together by
// tests/cuda/test_cuda_routed.py, test_cuda_ring.py and test_cuda_union.py.
#pragma once

__device__ __forceinline__ unsigned prmt(unsigned a, unsigned b, unsigned sel) {
    unsigned d;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
    return d;
}

__device__ __forceinline__ unsigned fma_bf16x2(unsigned a, unsigned b, unsigned c) {
    unsigned d;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

// d += A (16 x 16) * B (16 x 8): a0/a2 hold row g, a1/a3 row g + 8; b0/b1 column g.
__device__ __forceinline__ void mma_bf16(float (&d)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                         unsigned b0, unsigned b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// The two E4M3 scales of a chunk (bytes 0 and 1 of s16) as fp32 e4m3 * 2^-8 (exact, subnormals too).
__device__ __forceinline__ void chunk_scales_f32(unsigned s16, float& s0, float& s1) {
    const unsigned x = prmt(s16, 0u, 0x5150u);  // [b0, 0, b1, 0]
    f16x2_to_f32(((x & 0x00800080u) << 8) | ((x & 0x007f007fu) << 7), s0, s1);
}

// The two block scales of a chunk (bytes 0 and 1 of s16) as bf16 pairs: mul = s, add = -144 s,
// s = e4m3 * 2^-8 (chunk_scales_f32).
__device__ __forceinline__ void chunk_scales(unsigned s16, unsigned (&mul)[2], unsigned (&add)[2]) {
    float f[2];
    chunk_scales_f32(s16, f[0], f[1]);
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        mul[i] = prmt(__float_as_uint(f[i]), 0u, 0x3232u);
        add[i] = prmt(__float_as_uint(-144.0f * f[i]), 0u, 0x3232u);
    }
}

// 32 nibbles (one 16-byte chunk) -> 16 bf16 pairs: b[i] holds k = 2i, 2i + 1 of the chunk.
__device__ __forceinline__ void dequant_chunk(const uint4& w, unsigned s16, unsigned (&b)[16]) {
    unsigned mul[2], add[2];
    chunk_scales(s16, mul, add);
    const unsigned words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int q = 0; q < 4; ++q) {
        const unsigned wq = words[q], m = wq & 0x77777777u, sh = wq << 4;
#pragma unroll
        for (int h = 0; h < 2; ++h) {  // nibbles 4h .. 4h + 3 of the word
            const unsigned idx = h ? m >> 16 : m;
            const unsigned pos = prmt(0x13121110u, 0x1c181614u, idx);    // 16 + v
            const unsigned neg = prmt(0x0d0e0f10u, 0x04080a0cu, idx);    // 16 - v
            const unsigned sgn = prmt(wq, sh, h ? 0xbfaeu : 0x9d8cu);    // 0xff where the nibble is negative
            const unsigned lo = (pos & ~sgn) | (neg & sgn);
            const unsigned s = q >> 1;  // 16-k group
            b[4 * q + 2 * h] = fma_bf16x2(prmt(lo, 0x43434343u, 0x4140u), mul[s], add[s]);
            b[4 * q + 2 * h + 1] = fma_bf16x2(prmt(lo, 0x43434343u, 0x4342u), mul[s], add[s]);
        }
    }
}

// One step of a lane (g, t): its chunks of P matrices (w[2p]: row n0 + g, w[2p + 1]: row n0 + g + 8,
// with their two E4M3 block scales in sc) against 32 k of x row g (xv), added to acc[p].
template <int P>
__device__ __forceinline__ void mma_chunks(const uint4 (&w)[2 * P], const unsigned (&sc)[2 * P], const uint4 (&xv)[4],
                                           float (&acc)[P][4]) {
#pragma unroll
    for (int p = 0; p < P; ++p) {
        unsigned lo[16], hi[16];  // rows n0 + g and n0 + g + 8
        dequant_chunk(w[2 * p], sc[2 * p], lo);
        dequant_chunk(w[2 * p + 1], sc[2 * p + 1], hi);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const uint4& x4 = xv[j >> 1];
            const unsigned xa = (j & 1) ? x4.z : x4.x, xb = (j & 1) ? x4.w : x4.y;  // k 4j..4j+1, 4j+2..4j+3
            mma_bf16(acc[p], lo[2 * j], hi[2 * j], lo[2 * j + 1], hi[2 * j + 1], xa, xb);
        }
    }
}

// ---- the fp16 form (one-row ring kernels): unscaled e2m1 as fp16, the block scale on the fp32 side ----
// A nibble's magnitude is looked up (PRMT) as the HIGH byte of the fp16 2 |e2m1| in {0, 1, 2, 3, 4, 6,
// 8, 12} (low byte 0 for all eight), its sign ORed into bit 7 of that byte: 3 instructions per 4
// nibbles, then one PRMT per pair spreads the bytes into an fp16 pair. No FMA: the E4M3 scale
// (as e4m3 * 2^-8, exactly) multiplies an mma's fp32 partial of one 16-k group instead, so
// partial * scale * (scale_2 * 128) is the same scaling as the bf16 form's.
__device__ __forceinline__ void mma_f16(float (&d)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                        unsigned b0, unsigned b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// A bf16 pair as an fp16 pair (round to nearest; exact for |v| in [2^-17, 65504] at bf16 precision).
__device__ __forceinline__ unsigned bf16x2_to_f16x2(unsigned v) {
    unsigned d;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(bf16_hi(v)), "f"(bf16_lo(v)));
    return d;
}

// 32 nibbles (one 16-byte chunk) -> 16 fp16 pairs of 2 e2m1: b[i] holds k = 2i, 2i + 1 of the chunk.
__device__ __forceinline__ void decode_chunk_f16(const uint4& w, unsigned (&b)[16]) {
    const unsigned words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int q = 0; q < 4; ++q) {
        const unsigned wq = words[q], m = wq & 0x77777777u, sh = wq << 4;
#pragma unroll
        for (int h = 0; h < 2; ++h) {  // nibbles 4h .. 4h + 3 of the word
            const unsigned mag = prmt(0x42403c00u, 0x4a484644u, h ? m >> 16 : m);  // high bytes of fp16 2|v|
            const unsigned sgn = prmt(wq, sh, h ? 0xbfaeu : 0x9d8cu);               // 0xff where negative
            const unsigned sb = mag | (sgn & 0x80808080u);
            b[4 * q + 2 * h] = prmt(sb, 0u, 0x1404u);      // [0, byte 0, 0, byte 1]
            b[4 * q + 2 * h + 1] = prmt(sb, 0u, 0x3424u);  // [0, byte 2, 0, byte 3]
        }
    }
}

// Nibbles 4h .. 4h + 3 of the word q (m = q & 0x77777777, sh = q << 4) as two bf16 pairs: each
// magnitude picks (PRMT) its low byte from lo0 / lo1 and its high byte from hi0 / hi1 (magnitudes 0..3
// / 4..7), the sign is ORed into the high byte, one PRMT per pair interleaves the bytes. p0: nibbles
// 4h, 4h + 1; p1: nibbles 4h + 2, 4h + 3. 6 instructions.
__device__ __forceinline__ void lookup_bf16_pairs(unsigned q, unsigned m, unsigned sh, int h, unsigned lo0,
                                                  unsigned lo1, unsigned hi0, unsigned hi1, unsigned& p0,
                                                  unsigned& p1) {
    const unsigned idx = h ? m >> 16 : m;
    const unsigned lo = prmt(lo0, lo1, idx);
    const unsigned sgn = prmt(q, sh, h ? 0xbfaeu : 0x9d8cu);  // 0xff where negative
    const unsigned hi = prmt(hi0, hi1, idx) | (sgn & 0x80808080u);
    p0 = prmt(lo, hi, 0x5140u);
    p1 = prmt(lo, hi, 0x7362u);
}

// The unscaled bf16 form: 32 nibbles -> 16 bf16 pairs of 2 e2m1 (exact: {0, 1, 2, 3, 4, 6, 8, 12}), the
// block scale applied to fp32 partials as in the fp16 form, but the input stays bf16 (exact for any
// bf16 x): lookup_bf16_pairs with the bytes of bf16 2|v|, 6 instructions per 4 nibbles.
#define BF16U_BYTES 0x40008000u, 0x4000c080u, 0x40403f00u, 0x41414040u  // low / high bytes of bf16 2|v|

__device__ __forceinline__ void decode_chunk_bf16u(const uint4& w, unsigned (&b)[16]) {
    const unsigned words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int q = 0; q < 4; ++q) {
        const unsigned wq = words[q], m = wq & 0x77777777u, sh = wq << 4;
#pragma unroll
        for (int h = 0; h < 2; ++h)  // nibbles 4h .. 4h + 3 of the word
            lookup_bf16_pairs(wq, m, sh, h, BF16U_BYTES, b[4 * q + 2 * h], b[4 * q + 2 * h + 1]);
    }
}

// The placed form: no lookup. Nibbles p and p + 4 of a word (k 8q + p and 8q + p + 4 of the chunk's word q)
// become one bf16 pair by bit placement: the sign to bit 15 / 31, the three magnitude bits (e1 e0 m) to
// bits 8..6 / 24..22, i.e. e2m1 x 2^-126 (+-0.5 a bf16 subnormal, which the mma takes exactly). 4
// instructions per pair (two shifts, two LOP3), no table. The x pair it meets must hold the same two k
// (pair_halves), scaled by a power of two that keeps the products normal in fp32.
__device__ __forceinline__ unsigned umulhi_asm(unsigned a, unsigned b) {
    unsigned d;
    asm("mul.hi.u32 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
}

// One word's four placed pairs: b[p] = nibbles p and p + 4.
__device__ __forceinline__ void placed_pairs(unsigned v, unsigned* b) {
    constexpr unsigned MAG = 0x01c001c0u, SGN = 0x80008000u;
    b[0] = ((v << 6) & MAG) | ((v << 12) & SGN);
    b[1] = ((v << 2) & MAG) | ((v << 8) & SGN);
    b[2] = (umulhi_asm(v, 1u << 30) & MAG) | ((v << 4) & SGN);  // v >> 2 on the FMA pipe
    b[3] = (umulhi_asm(v, 1u << 26) & MAG) | (v & SGN);         // v >> 6
}

__device__ __forceinline__ void decode_chunk_placed(const uint4& w, unsigned (&b)[16]) {
    const unsigned words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int q = 0; q < 4; ++q) placed_pairs(words[q], b + 4 * q);
}

// Eight consecutive bf16 (words w[0..3] = k 0..7) as the pairs decode_chunk_placed makes: (k p, k p + 4).
__device__ __forceinline__ void pair_halves(const unsigned* w, unsigned* out) {
    out[0] = prmt(w[0], w[2], 0x5410u);
    out[1] = prmt(w[0], w[2], 0x7632u);
    out[2] = prmt(w[1], w[3], 0x5410u);
    out[3] = prmt(w[1], w[3], 0x7632u);
}

// 2^e as fp32 (e in -126 .. 127) and as a bf16 pair.
__device__ __forceinline__ float exp2i(int e) { return __int_as_float((e + 127) << 23); }
__device__ __forceinline__ unsigned exp2i_bf16x2(int e) { return (unsigned)(e + 127) * 0x00800080u; }

// Eight natural bf16 (w[0..3]) as the placed form's x: paired (pair_halves), times s2 = 2^shift (exact).
__device__ __forceinline__ void placed_x8(const unsigned* w, unsigned s2, unsigned* out) {
    pair_halves(w, out);
#pragma unroll
    for (int i = 0; i < 4; ++i) out[i] = fma_bf16x2(out[i], s2, 0x80008000u);
}

// The largest |x| (bf16 bits; NaN above inf) over uint4s first, first + stride, ... < n of xv.
__device__ __forceinline__ unsigned abs_max_bits(const uint4* xv, int first, int stride, int n) {
    unsigned m = 0u;
    for (int i = first; i < n; i += stride) {
        const uint4 v = __ldg(xv + i);
        m = __vmaxu2(m, __vmaxu2(__vmaxu2(v.x & 0x7fff7fffu, v.y & 0x7fff7fffu),
                                 __vmaxu2(v.z & 0x7fff7fffu, v.w & 0x7fff7fffu)));
    }
    return max(m & 0xffffu, m >> 16);
}

// The placed form's shift for an x row whose largest |x| has the bf16 bits m: 2^s puts it below 2^120, so
// every product with a placed weight (>= 2^-127) of an element within 2^118 of the largest is a normal fp32,
// and nothing overflows. 0 for a row of zeros or one holding inf / NaN (they propagate as in the other forms).
__device__ __forceinline__ int placed_shift(unsigned m) {
    const int e = (int)(m >> 7);  // the biased exponent of the largest |x|: it is below 2^(e - 126)
    return m == 0u || e == 255 ? 0 : (e >= 119 ? 246 - e : 127);
}

// The gate, up and clamped SwiGLU outputs of one element (each rounded once to bf16).
__device__ __forceinline__ void glu_store(bf16_t* gate, bf16_t* up, bf16_t* act, int n, float g, float u,
                                          float limit) {
    const bf16_t gv = f32_to_bf16(g), uv = f32_to_bf16(u);
    gate[n] = gv;
    up[n] = uv;
    act[n] = swiglu_one(bf16_to_f32(gv), bf16_to_f32(uv), limit);
}
