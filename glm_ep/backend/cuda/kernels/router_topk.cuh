// The router's top-k of one row, for one warp (router.cu's router_topk; gemv_bf16.cu's fused
// router GEMV + top-k), mirroring glm_ep/mlp/routing.py::router_topk:
//   scores = sigmoid(logits)           (bf16 ladder: logits and scores rounded to bf16)
//   choice = scores + bias             selects ONLY; exact ties go to the lower expert id, and a
//                                      NaN choice ranks below every number (as -inf does)
//   weights = the UNBIASED scores of the chosen experts, / (sum + 1e-20) when renormalising,
//            then * routed_scale       (bf16 ladder: each stage rounded to bf16)
// The sum runs in numpy's order (sequential below 8 terms, eight pairwise lanes from 8 up) so the
// weights match the NumPy twin bit for bit. Include after common.cuh.
//
// NumPy twin: glm_ep/mlp/routing.py's router_topk (NumpyBackend.router_topk); held together by
// tests/cuda/test_cuda_router.py, bit for bit, ties and NaN included.
#pragma once

#ifndef ROUTER_MAX_TOP_K
#error "ROUTER_MAX_TOP_K is set by glm_ep/backend/cuda/kernel_loader.py"
#endif
#define TOPK_BATCH 16  // experts per lane whose logits are in flight at once: 512 experts in one trip

struct TopkParams {
    int E, K;
    float routed_scale;
    int renormalize, bf16_ladder;
};

// An order-preserving unsigned key of a float choice: NaN ranks as -inf, -0 as +0; every key of a
// number is > 0, so 0 marks an expert already taken.
__device__ __forceinline__ unsigned order_key(float c) {
    if (c != c) c = __uint_as_float(0xff800000u);
    c += 0.0f;  // -0 -> +0
    const unsigned u = __float_as_uint(c);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ float renorm_sum(const float* w, int k) {
    if (k < 8) {
        float s = 0.0f;
        for (int i = 0; i < k; ++i) s += w[i];
        return s;
    }
    float r[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) r[j] = w[j];
    int i = 8;
    for (; i + 8 <= k; i += 8)
#pragma unroll
        for (int j = 0; j < 8; ++j) r[j] += w[i + j];
    float s = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
    for (; i < k; ++i) s += w[i];
    return s;
}

// The best not yet taken of a lane's experts lane, lane + 32, ...: the highest key, the lowest id
// among equal keys (ids ascend, so only a strictly higher key replaces); key 0 when none is left.
__device__ __forceinline__ void lane_best(const unsigned* key, int E, unsigned& best_key, unsigned& best_id) {
    best_key = 0u;
    best_id = 0xffffffffu;
    for (int e = threadIdx.x & 31; e < E; e += 32) {
        const unsigned k = key[e];
        if (k > best_key) {
            best_key = k;
            best_id = (unsigned)e;
        }
    }
}

// One row's top-k by the calling warp: logits read with ld.global.cg (another block may have just
// written them), ``key`` / ``score`` E entries of shared memory each and ``chosen`` top-k ints of
// shared memory, all private to the warp. Each lane only ever reads and writes its own experts'
// keys (e = lane mod 32) and keeps its best in registers; a round is two warp reductions (the
// highest key, then the lowest id holding it) and a rescan by the one lane whose expert was taken.
__device__ __forceinline__ void topk_row(const float* lrow, const float* __restrict__ bias, int* ids, float* wts,
                                         const TopkParams& p, unsigned* key, float* score, int* chosen) {
    const int lane = threadIdx.x & 31, E = p.E, K = p.K;
    // TOPK_BATCH of a lane's logits and biases loaded before any is used: the shared stores below
    // go through generic pointers, so loads and stores would otherwise alternate, one global round
    // trip per expert a lane holds (9 at 288 experts)
    for (int e0 = lane; e0 < E; e0 += 32 * TOPK_BATCH) {
        float l[TOPK_BATCH], b[TOPK_BATCH];
#pragma unroll
        for (int j = 0; j < TOPK_BATCH; ++j) {
            const int e = e0 + 32 * j;
            l[j] = e < E ? __ldcg(lrow + e) : 0.0f;
            b[j] = e < E ? bias[e] : 0.0f;
        }
#pragma unroll
        for (int j = 0; j < TOPK_BATCH; ++j) {
            const int e = e0 + 32 * j;
            if (e >= E) break;
            const float lj = p.bf16_ladder ? round_bf16(l[j]) : l[j];
            float s = 1.0f / (1.0f + expf(-lj));
            if (p.bf16_ladder) s = round_bf16(s);
            score[e] = s;
            key[e] = order_key(s + b[j]);
        }
    }
    unsigned best_key, best_id;
    lane_best(key, E, best_key, best_id);

    for (int k = 0; k < K; ++k) {
        const unsigned top = __reduce_max_sync(0xffffffffu, best_key);
        const unsigned e = __reduce_min_sync(0xffffffffu, best_key == top ? best_id : 0xffffffffu);
        if (lane == 0) chosen[k] = (int)e;
        if ((unsigned)lane == (e & 31u)) {  // the owner of the taken expert moves to its next best
            key[e] = 0u;
            lane_best(key, E, best_key, best_id);
        }
    }
    __syncwarp();  // chosen[] and score[] (written by other lanes) read by lane 0 below

    if (lane == 0) {
        float w[ROUTER_MAX_TOP_K];
        for (int k = 0; k < K; ++k) w[k] = score[chosen[k]];
        if (p.renormalize) {
            const float denom = renorm_sum(w, K) + 1e-20f;
            for (int k = 0; k < K; ++k) {
                w[k] = w[k] / denom;
                if (p.bf16_ladder) w[k] = round_bf16(w[k]);
            }
        }
        for (int k = 0; k < K; ++k) {
            float v = w[k] * p.routed_scale;
            if (p.bf16_ladder) v = round_bf16(v);
            ids[k] = chosen[k];
            wts[k] = v;
        }
    }
}
