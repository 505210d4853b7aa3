"""A lane-level model of the narrow register engine's K loop (gemm_nvfp4_register.cuh, k_loop_narrow): the
stage layout its copies write (x_slot, w_slot, the scale rows), what each lane reads back (woff, soff / ssel,
xoff ^ 16 kk), the bit-level scale and placed-weight decoding, pair_halves, and mma.sync m16n8k16's fragment
layout, for one warp. Checks the warp's transposed sums against W x^T in float64, that every quarter warp's x read
hits 8 distinct bank groups, and (B.patch) that the K loop's rounds of STAGES stages read each stage from the slot
it was copied into, never a slot a copy is refilling.

    python docs/perf/runs/2026-12-07-narrow-lanes/lane_model.py"""
import itertools, sys
import numpy as np, ml_dtypes

BF = ml_dtypes.bfloat16
E2M1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6])

def bf_pair(u):  # u32 -> (lo, hi) float64
    u = np.uint32(u)
    return (np.array([u & 0xffff], np.uint16).view(BF).astype(np.float64)[0],
            np.array([u >> 16], np.uint16).view(BF).astype(np.float64)[0])

def to_pair(lo, hi):
    a = np.array([lo, hi], np.float64).astype(np.float32).astype(BF)
    assert np.array_equal(a.astype(np.float64), np.array([lo, hi])), "inexact bf16"
    v = a.view(np.uint16).astype(np.uint32)
    return int(v[0] | (v[1] << 16))

def fma_bf16x2(a, b):  # a * b + (-0), rounded to bf16: here always exact, asserted
    (a0, a1), (b0, b1) = bf_pair(a), bf_pair(b)
    return to_pair(a0 * b0, a1 * b1)

def prmt(a, b, sel):
    by = list(int(a).to_bytes(4, "little")) + list(int(b).to_bytes(4, "little"))
    return int.from_bytes(bytes(by[(sel >> (4 * i)) & 7] for i in range(4)), "little")

def exp2i_bf16x2(e): return ((e + 127) * 0x00800080) & 0xffffffff

def e4m3_pair_placed(v): return (v & 0x80008000) | ((v >> 4) & 0x07f007f0)

def placed_pairs(v):
    M, S = 0x01c001c0, 0x80008000
    u = lambda x: x & 0xffffffff
    return [u(((v << 6) & M) | ((v << 12) & S)), u(((v << 2) & M) | ((v << 8) & S)),
            ((v >> 2) & M) | ((v << 4) & S), ((v >> 6) & M) | (v & S)]

def lookup_word(q, s2):  # dequant_word's result by value: b[j] = (k 2j, k 2j + 1) x scale
    nib = [(q >> (4 * i)) & 15 for i in range(8)]
    s = bf_pair(s2)[0]
    return [to_pair(E2M1[nib[2 * j]] * s, E2M1[nib[2 * j + 1]] * s) for j in range(4)]

def pair_halves(w):
    return [prmt(w[0], w[2], 0x5410), prmt(w[0], w[2], 0x7632), prmt(w[1], w[3], 0x5410), prmt(w[1], w[3], 0x7632)]

def w_slot(BK, n, h): return h ^ ((n // (256 // BK)) % (BK // 32))

def run(BK, MT, ACTIVE, placed, warp, K, seed, paired_x=False):
    """paired_x (C.patch): x comes staged in the paired order (stage_pairs) and the placed lane reads its pairs as
    they are, without pair_halves."""
    rng = np.random.default_rng(seed)
    S, BM, WARPS, NT = BK // 32, 8 * MT, 4, 4
    BN = 32 * WARPS
    x_bytes, w_bytes = BM * BK * 2, BN * BK // 2
    W_OFF, S_OFF = x_bytes, x_bytes + w_bytes
    size = S_OFF + BN * BK // 16
    codes = rng.integers(0, 16, (BN, K))
    sbytes = rng.integers(0, 256, (BN, K // 16)); sbytes[sbytes == 0x7f] = 0x38; sbytes[sbytes == 0xff] = 0xb8
    sbytes[0, 0], sbytes[1, 0] = 0x01, 0x05  # subnormal scales
    e4 = sbytes.astype(np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    W = E2M1[codes] * np.repeat(e4, 16, axis=1) * 2.0**-8  # the products dequant makes (scale_2 aside)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)  # byte j: k 2j low, 2j + 1 high
    X = rng.standard_normal((BM, K)).astype(BF).astype(np.float64)
    X[ACTIVE * 8:] = 0  # rows past the active tiles are not read by the model's loop
    order = np.concatenate([8 * c + np.array([0, 4, 1, 5, 2, 6, 3, 7]) for c in range(K // 8)])  # paired_order
    xb = np.ascontiguousarray((X[:, order] if paired_x else X).astype(BF)).view(np.uint16)
    def x_slot(c, r): return c ^ (((c >> 3) & 1) << 1) ^ (r & 1)
    T = np.zeros((32, ACTIVE, 2, 4))
    wr = [32 * warp + 8 * j for j in range(NT)]
    f1, f2 = exp2i_bf16x2(119 if placed else 112), exp2i_bf16x2(119)
    for kb in range(K // BK):
        st = np.zeros(size, np.uint8)
        for r in range(BM):                       # x copies
            for ch in range(BK // 8):
                d = 16 * (r * (BK // 8) + x_slot(ch, r))
                st[d:d + 16] = xb[r, kb * BK + 8 * ch: kb * BK + 8 * ch + 8].view(np.uint8)
        for n in range(BN):                       # weight and scale copies
            for h in range(BK // 32):
                d = W_OFF + 16 * (n * (BK // 32) + w_slot(BK, n, h))
                st[d:d + 16] = packed[n, kb * BK // 2 + 16 * h: kb * BK // 2 + 16 * h + 16]
            st[S_OFF + n * (BK // 16): S_OFF + (n + 1) * (BK // 16)] = sbytes[n, kb * BK // 16:(kb + 1) * BK // 16]
        u32 = lambda off: int(st[off:off + 4].view(np.uint32)[0])
        regs = {}  # lane -> (w[S][NT], sc[NT], xoff)
        for lane in range(32):
            g, t = lane >> 2, lane & 3
            woff = [W_OFF + 16 * ((wr[j] + g) * S + w_slot(BK, wr[j] + g, t if S == 4 else t >> 1)) + (0 if S == 4 else 8 * (t & 1)) for j in range(NT)]
            soff = [S_OFF + 4 * ((wr[j] + g) * (BK // 64) + (t >> 1 if S == 4 else 0)) for j in range(NT)]
            m = ((t >> 1) << 1 if S == 4 else 0) ^ (g & 1)
            xoff = [16 * ((8 * i + g) * (BK // 8) + S * t + m) for i in range(ACTIVE)]
            a = 2 * (t & 1) if S == 4 else t
            ssel = 0x0404 | (a << 4) | ((a + 1 if S == 4 else a) << 12)
            w = [[u32(woff[j] + 4 * kk) for j in range(NT)] for kk in range(S)]
            sc = []
            for j in range(NT):
                pl = e4m3_pair_placed(prmt(u32(soff[j]), 0, ssel))
                s_ = fma_bf16x2(pl, f1)
                if placed: s_ = fma_bf16x2(s_, f2)
                sc.append(s_)
            regs[lane] = (w, sc, xoff)
        for kk in range(S):
            frag = {}
            for lane in range(32):
                w, sc, xoff = regs[lane]
                b = []
                for j in range(NT):
                    lo, hi = bf_pair(sc[j])
                    half = (lo if (kk >> 1) == 0 else hi) if S == 4 else lo
                    if S == 2: assert lo == hi
                    s2 = to_pair(half, half)
                    if placed:
                        b.append([fma_bf16x2(p, s2) for p in placed_pairs(w[kk][j])])
                    else:
                        b.append(lookup_word(w[kk][j], s2))
                xs = []
                for i in range(ACTIVE):
                    off = xoff[i] ^ (16 * kk)
                    xw = [u32(off + 4 * q) for q in range(4)]
                    xs.append(pair_halves(xw) if placed and not paired_x else xw)
                frag[lane] = (b, xs)
            for i, jm in itertools.product(range(ACTIVE), range(NT // 2)):
                for half in range(2):  # the two mma of a step: pairs 0, 1 then 2, 3
                    A, B = np.zeros((16, 16)), np.zeros((16, 8))
                    for lane in range(32):
                        g, t = lane >> 2, lane & 3
                        b, xs = frag[lane]
                        p, q = b[2 * jm], b[2 * jm + 1]
                        A[g, 2*t:2*t+2] = bf_pair(p[2*half]); A[g+8, 2*t:2*t+2] = bf_pair(q[2*half])
                        A[g, 2*t+8:2*t+10] = bf_pair(p[2*half+1]); A[g+8, 2*t+8:2*t+10] = bf_pair(q[2*half+1])
                        B[2*t:2*t+2, g] = bf_pair(xs[i][2*half]); B[2*t+8:2*t+10, g] = bf_pair(xs[i][2*half+1])
                    D = A @ B
                    for lane in range(32):
                        g, t = lane >> 2, lane & 3
                        T[lane, i, jm] += [D[g, 2*t], D[g, 2*t+1], D[g+8, 2*t], D[g+8, 2*t+1]]
    scale_fix = 2.0**-8 if not placed else 2.0**-8  # both: e2m1 x e4m3 x 2^-8
    bad = 0
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        for i, jm in itertools.product(range(ACTIVE), range(NT // 2)):
            r0, r1 = wr[2 * jm] + g, wr[2 * jm + 1] + g
            want = [W[r0] @ X[8*i+2*t], W[r0] @ X[8*i+2*t+1], W[r1] @ X[8*i+2*t], W[r1] @ X[8*i+2*t+1]]
            if not np.allclose(T[lane, i, jm], want, rtol=1e-12, atol=1e-9):
                bad += 1
    return bad

if __name__ == "__main__":
    fails = 0
    cases = [(128, 2, 1, True, False), (128, 2, 2, True, False), (128, 2, 1, True, True), (128, 2, 2, True, True),
             (128, 2, 2, False, False), (64, 1, 1, False, False), (64, 2, 2, False, False), (64, 8, 4, False, False),
             (64, 8, 8, False, False)]
    for BK, MT, ACTIVE, placed, paired_x in cases:
        for warp in (0, 1, 3):
            bad = run(BK, MT, ACTIVE, placed, warp, K=2 * BK, seed=warp + BK, paired_x=paired_x)
            print(f"BK {BK} MT {MT} ACTIVE {ACTIVE} placed {placed} x paired {paired_x} warp {warp}: "
                  f"{'ok' if bad == 0 else f'{bad} lane sums wrong'}")
            fails += bad
    # the bank check: each quarter warp's x read at each step hits 8 distinct 16-byte bank groups
    for BK in (64, 128):
        S = BK // 32
        for kk in range(S):
            for q in range(4):
                offs = []
                for lane in range(8 * q, 8 * q + 8):
                    g, t = lane >> 2, lane & 3
                    m = ((t >> 1) << 1 if S == 4 else 0) ^ (g & 1)
                    offs.append(((16 * ((8 * 0 + g) * (BK // 8) + S * t + m)) ^ (16 * kk)) // 16 % 8)
                assert len(set(offs)) == 8, (BK, kk, q, offs)
    print("x reads conflict-free")
    # B.patch's rounds: the prologue copies stages 0 .. STAGES - 2 (each copy moves the sources a stage on), then
    # step i of the round at k0 copies stage k0 + i + STAGES - 1 (sources + i stages) into slot (i + STAGES - 1) %
    # STAGES and reads slot i; the sources move STAGES stages after each round
    for STAGES in (3, 4, 6):
        for kblocks in range(1, 20):
            slot, src = {}, 0
            for s_ in range(min(STAGES - 1, kblocks)):
                slot[s_ % STAGES], src = src, src + 1
            for k0 in range(0, kblocks, STAGES):
                for i in range(min(STAGES, kblocks - k0)):
                    if k0 + i + STAGES - 1 < kblocks:
                        assert (i + STAGES - 1) % STAGES != i
                        slot[(i + STAGES - 1) % STAGES] = src + i
                    assert slot[i] == k0 + i, (STAGES, kblocks, k0 + i, slot)
                src += STAGES
    print("rounds read every stage from its slot")
    print("FAILED" if fails else "ALL OK")
    sys.exit(1 if fails else 0)
