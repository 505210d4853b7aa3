// The router's top-k, one warp-sized block per row (router_topk.cuh holds the math and its
// contract with glm_ep/mlp/routing.py::router_topk).
//
// NumPy twin: glm_ep/mlp/routing.py's router_topk (NumpyBackend.router_topk); held together by
// tests/cuda/test_cuda_router.py, bit for bit.
#include "common.cuh"
#include "router_topk.cuh"

// Block of 32 threads, one row per block; dynamic shared memory 8 * E bytes.
extern "C" __global__ void __launch_bounds__(32)
router_topk(const float* __restrict__ logits, const float* __restrict__ bias, int* __restrict__ ids,
            float* __restrict__ wts, int E, int K, float routed_scale, int renormalize, int bf16_ladder) {
    pdl_enter();
    unsigned* key = (unsigned*)dyn_smem;
    __shared__ int chosen[ROUTER_MAX_TOP_K];
    const int t = blockIdx.x;
    topk_row(logits + (long long)t * E, bias, ids + t * K, wts + t * K, TopkParams{E, K, routed_scale, renormalize,
             bf16_ladder}, key, (float*)(key + E), chosen);
}
