// The router's top-k, one warp-sized block per row, mirroring glm_ep/routing.py::router_topk:
//   scores = sigmoid(logits)           (bf16 ladder: logits and scores rounded to bf16)
//   choice = scores + bias             selects ONLY; exact ties go to the lower expert id, and a
//                                      NaN choice ranks below every number (as -inf does)
//   weights = the UNBIASED scores of the chosen experts, / (sum + 1e-20) when renormalising,
//            then * routed_scale       (bf16 ladder: each stage rounded to bf16)
// The sum runs in numpy's order (sequential below 8 terms, eight pairwise lanes from 8 up) so the
// weights match the NumPy twin bit for bit.
#include "common.cuh"

#ifndef ROUTER_MAX_TOP_K
#error "ROUTER_MAX_TOP_K is set by glm_ep/backend/cuda/loader.py"
#endif

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

// Block of 32 threads, one row per block; dynamic shared memory 8 * E bytes.
extern "C" __global__ void __launch_bounds__(32)
router_topk(const float* __restrict__ logits, const float* __restrict__ bias, int* __restrict__ ids,
            float* __restrict__ wts, int E, int K, float routed_scale, int renormalize, int bf16_ladder) {
    unsigned* key = (unsigned*)dyn_smem;
    float* score = (float*)(key + E);
    __shared__ int chosen[ROUTER_MAX_TOP_K];
    const int t = blockIdx.x, lane = threadIdx.x;
    const float* lrow = logits + (long long)t * E;

    for (int e = lane; e < E; e += 32) {
        float l = lrow[e];
        if (bf16_ladder) l = round_bf16(l);
        float s = 1.0f / (1.0f + expf(-l));
        if (bf16_ladder) s = round_bf16(s);
        score[e] = s;
        key[e] = order_key(s + bias[e]);
    }
    __syncwarp();

    for (int k = 0; k < K; ++k) {
        // best (highest key, then lowest id) of this lane's experts, then of the warp
        u64_t best = 0;
        for (int e = lane; e < E; e += 32) {
            const u64_t cand = ((u64_t)key[e] << 32) | (0xffffffffu - (unsigned)e);
            best = cand > best ? cand : best;
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const u64_t other = __shfl_xor_sync(0xffffffffu, best, o);
            best = other > best ? other : best;
        }
        const int e = (int)(0xffffffffu - (unsigned)(best & 0xffffffffu));
        if (lane == 0) {
            chosen[k] = e;
            key[e] = 0u;  // taken
        }
        __syncwarp();
    }

    if (lane == 0) {
        float w[ROUTER_MAX_TOP_K];
        for (int k = 0; k < K; ++k) w[k] = score[chosen[k]];
        if (renormalize) {
            const float denom = renorm_sum(w, K) + 1e-20f;
            for (int k = 0; k < K; ++k) {
                w[k] = w[k] / denom;
                if (bf16_ladder) w[k] = round_bf16(w[k]);
            }
        }
        for (int k = 0; k < K; ++k) {
            float v = w[k] * routed_scale;
            if (bf16_ladder) v = round_bf16(v);
            ids[t * K + k] = chosen[k];
            wts[t * K + k] = v;
        }
    }
}
