// The per-warp shared-memory ring of the NVFP4 GEMV kernels of gemv_nvfp4_ring.cu (decode, one row)
// and gemv_nvfp4_union.cu (verify, a union of rows): the stage layout, the weight copies, the bf16
// form's mma over a landed slab and the cp.async pipeline both run. Include after common.cuh,
// nvfp4_mma.cuh and async_copy.cuh.
//
// NumPy twin: NumpyBackend.moe_gemv, moe_gate_up_act and their union forms (glm_ep/backend/numpy_backend.py); held
// together by tests/cuda/test_cuda_ring.py and test_cuda_union.py.
#pragma once

#if !defined(RING_WARPS) || !defined(RING_CLAIMS_MIN_ITEMS)
#error "RING_WARPS and RING_CLAIMS_MIN_ITEMS are set by glm_ep/backend/cuda/kernel_loader.py"
#endif
#define RING_THREADS (RING_WARPS * 32)

// One slab (T steps of 128 k) of one warp's item. Weight piece j (16 bytes, chunk j of the slab) of
// row r is stored at piece j ^ 4 (r & 1), so the quads of rows g and g + 1 read disjoint banks. R x
// rows: 1 for decode, up to 8 for a union item (piece j of x row r at xswz<R>(r, j)).
template <int P, int T, int R = 1>
struct RingStage {
    uint4 w[P][16][4 * T];  // [matrix][row - n0][piece]: the slab's 64 T bytes of the row
    uint4 s[P][16][T / 2];  // [matrix][row - n0]: the slab's 8 T scale bytes
    uint4 x[R][16 * T];     // the slab's 128 T k of each x row
};

__device__ __forceinline__ int swz(int row, int piece) { return piece ^ ((row & 1) << 2); }

// A union step reads, per phase of 8 lanes, pieces 16 s + 4 t + q (t = 0..3) of two x rows: XOR bit 1
// with bit 3 and bit 0 with the row's parity so the 8 pieces fall in 8 distinct bank groups.
template <int R>
__device__ __forceinline__ int xswz(int row, int piece) {
    return R == 1 ? piece : piece ^ (((piece >> 3) & 1) << 1) ^ (row & 1);
}

// Where the producer reads an item: row n0 of each matrix's weights and scales, and x.
template <int P>
struct ItemSrc {
    const unsigned char* w[P];
    const unsigned char* s[P];
    const unsigned char* x;
    size_t row_bytes, scale_row_bytes;
};

// Copy slab b of the item's weights and (SCALES) scales: 32 consecutive 16-byte pieces per instruction
// (rows of 64 T contiguous bytes).
template <int P, int T, int R, bool SCALES = true>
__device__ __forceinline__ void issue_weights(RingStage<P, T, R>& st, const ItemSrc<P>& src, int b) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int p = 0; p < P; ++p) {
#pragma unroll
        for (int q = 0; q < 2 * T; ++q) {
            const int i = 32 * q + lane, r = i / (4 * T), j = i % (4 * T);
            cp_async16(smem_u32(&st.w[p][r][swz(r, j)]),
                       src.w[p] + (size_t)r * src.row_bytes + 64 * T * (size_t)b + 16 * j);
        }
        constexpr int SC = SCALES ? 8 * T : 0;  // scale pieces: 16 rows x T / 2 (T = 2: fewer than a warp's lanes)
#pragma unroll
        for (int q = 0; q < (SC + 31) / 32; ++q) {
            const int i = 32 * q + lane, r = i / (T / 2), j = i % (T / 2);
            if (SC % 32 == 0 || i < SC)
                cp_async16(smem_u32(&st.s[p][r][j]),
                           src.s[p] + (size_t)r * src.scale_row_bytes + 8 * T * (size_t)b + 16 * j);
        }
    }
}

// The slab's T steps: lane (g, t) takes chunk 4 s + t of rows g, g + 8 and of x row g (the mma's B
// column g; decode: only row 0, the other columns zero).
template <int P, int T, int R = 1>
__device__ __forceinline__ void consume_slab(const RingStage<P, T, R>& st, float (&acc)[P][4]) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int s = 0; s < T; ++s) {
        const int c = 4 * s + t;
        uint4 w[2 * P], xv[4];
        unsigned sc[2 * P];
#pragma unroll
        for (int p = 0; p < P; ++p) {
            w[2 * p] = st.w[p][g][swz(g, c)];
            w[2 * p + 1] = st.w[p][g + 8][swz(g + 8, c)];
            sc[2 * p] = ((const unsigned short*)&st.s[p][g][0])[c];
            sc[2 * p + 1] = ((const unsigned short*)&st.s[p][g + 8][0])[c];
        }
        const int r = g < R ? g : 0;
#pragma unroll
        for (int q = 0; q < 4; ++q) xv[q] = g < R ? st.x[r][xswz<R>(r, 4 * c + q)] : make_uint4(0u, 0u, 0u, 0u);
        mma_chunks<P>(w, sc, xv, acc);
    }
}

// Outputs of one item (lanes t = 0 hold x row 0 of rows n0 + g, n0 + g + 8).
struct RingOut {
    bf16_t* out;  // P = 1
    bf16_t *gate, *up, *act;  // P = 2
    float limit;
};

// The per-warp cp.async pipeline of both ring forms. A warp's first item is w0 (< W, the launch's warps); past it,
// with `claims` (two uint32, zero between launches) and at least RING_CLAIMS_MIN_ITEMS items a warp, each item is
// the next value of the counter claims[0], so a warp that streams faster takes more items and the launch's warps
// finish together; otherwise w0 + W, w0 + 2 W, ... < items (every warp sees the same items, so all take the same
// way). claims[1] counts the warps done claiming; the last of the W zeroes both for the next launch. Each item is
// `slabs` slabs; D - 1 slabs stay in flight ACROSS item boundaries, so the producer runs up to D - 1 items ahead of
// the consumer, which takes them in the order the producer started them (a queue in registers). The claim of the
// item after the producer's is sent when the producer starts one, so its round trip overlaps that item's slabs.
// The steps are callables:
// src(item) points the producer at an item, issue(stage, slab) copies a slab of the producer's item,
// consume(stage, item, slab) multiplies a landed slab of the item into the caller's accumulators, finish(item)
// stores a finished item and clears them; start() runs once on every warp (a warp without items too), once the
// first copies are in flight, before the first consume.
struct NoStart {
    __device__ __forceinline__ void operator()() const {}
};

template <int D, typename Stage, typename Src, typename Issue, typename Consume,
          typename Finish, typename Start = NoStart>
__device__ __forceinline__ void ring_pipeline(Stage* ring, int w0, int W, int items, int slabs, unsigned* claims,
                                              Src&& src, Issue&& issue, Consume&& consume, Finish&& finish,
                                              Start&& start = Start{}) {
    static_assert(D >= 2 && D <= 4, "a ring of 2..4 stages");
    if (slabs <= 0) items = 0;  // no K (the wrappers refuse it): nothing to stream, and no item ever ends
    if (items < RING_CLAIMS_MIN_ITEMS * W) claims = nullptr;  // too few items a warp to share out
    const bool lead = (threadIdx.x & 31) == 0;
    int ahead[D - 1];  // items the producer has started and the consumer has not, oldest first
    int queued = 0;
    auto push = [&](int item) {
#pragma unroll
        for (int i = 0; i < D - 1; ++i)
            if (i == queued) ahead[i] = item;
        ++queued;
    };
    auto pop = [&]() {
        const int item = ahead[0];
#pragma unroll
        for (int i = 0; i + 1 < D - 1; ++i) ahead[i] = ahead[i + 1];
        --queued;
        return item;
    };
    unsigned claimed = 0u;  // lead lane: the counter's value for the item after the producer's
    auto ask = [&]() {
        if (claims != nullptr && lead) claimed = atomicAdd(claims, 1u);
    };
    int p_item = w0, p_s = 0;  // producer: the item and slab of the next copy (p_item >= items: none left)
    if (p_item < items) {
        src(p_item);
        ask();
    }
    auto produce = [&](Stage& st) {
        if (p_item >= items) return;
        if (p_s == slabs) {  // warp-uniform
            p_item = claims != nullptr ? W + (int)__shfl_sync(0xffffffffu, claimed, 0) : p_item + W;
            p_s = 0;
            if (p_item >= items) return;
            src(p_item);
            ask();
            push(p_item);
        }
        issue(st, p_s++);
    };
#pragma unroll
    for (int d = 0; d < D - 1; ++d) {
        produce(ring[d]);
        cp_async_commit();
    }
    start();
    int c_item = w0, c_s = 0, stage = 0, fill = D - 1;
    while (c_item < items) {
        cp_async_wait<D - 2>();  // the consumer's slab has landed (this lane's copies) ...
        __syncwarp();            // ... and every lane's; every lane is done with the slab before it
        produce(ring[fill]);
        cp_async_commit();
        fill = fill + 1 == D ? 0 : fill + 1;
        consume(ring[stage], c_item, c_s);
        stage = stage + 1 == D ? 0 : stage + 1;
        if (++c_s == slabs) {  // warp-uniform
            finish(c_item);
            c_s = 0;
            c_item = queued ? pop() : items;  // the producer is a slab ahead: it has started the next item if any
        }
    }
    if (claims != nullptr) {
        __syncwarp();
        if (lead) {
            __threadfence();  // this warp's claims before its count
            if (atomicAdd(claims + 1, 1u) == (unsigned)W - 1) {  // every warp is done claiming
                __threadfence();  // ... and every claim is ordered before the reset
                claims[0] = 0u;
                claims[1] = 0u;
            }
        }
    }
}

template <int P>
__device__ __forceinline__ void zero_acc(float (&acc)[P][4]) {
#pragma unroll
    for (int p = 0; p < P; ++p)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[p][i] = 0.0f;
}
