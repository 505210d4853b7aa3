// Elementwise ops of an MLP site: the clamped SwiGLU, the routed + shared combine (plain and
// through the expert-sorted permutation), the residual add, and the bf16 -> fp32 upcast.
//
// Numerics follow glm_ep/backend/numpy_backend.py operation by operation: the combine adds its
// slots in order k = 0 .. K-1 into an fp32 zero, each product rounded before its add (no fused
// multiply-add), then the shared row, and rounds to bf16 once.
//
// NumPy twin: NumpyBackend.swiglu, add and combine (glm_ep/backend/numpy_backend.py); held together by
// tests/cuda/test_cuda_elementwise.py.
#include "common.cuh"

#ifndef ELEM_THREADS
#error "ELEM_THREADS is set by glm_ep/backend/cuda/kernel_loader.py"
#endif
#ifndef COMBINE_THREADS
#error "COMBINE_THREADS is set by glm_ep/backend/cuda/kernel_loader.py"
#endif
#ifndef COMBINE_VEC
#error "COMBINE_VEC is set by glm_ep/backend/cuda/kernel_loader.py"
#endif
static_assert(COMBINE_VEC == 8, "a combine thread's hidden elements are one 16-byte vector of bf16");

// out = bf16(silu(min(g, L)) * clamp(u, -L, L)); grid-stride over n elements.
extern "C" __global__ void __launch_bounds__(ELEM_THREADS)
swiglu_bf16(const bf16_t* __restrict__ gate, const bf16_t* __restrict__ up, bf16_t* __restrict__ out,
            long long n, float limit) {
    pdl_enter();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        out[i] = swiglu_one(bf16_to_f32(gate[i]), bf16_to_f32(up[i]), limit);
}

extern "C" __global__ void __launch_bounds__(ELEM_THREADS)
add_bf16(const bf16_t* __restrict__ a, const bf16_t* __restrict__ b, bf16_t* __restrict__ out, long long n) {
    pdl_enter();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        out[i] = f32_to_bf16(bf16_to_f32(a[i]) + bf16_to_f32(b[i]));
}

extern "C" __global__ void __launch_bounds__(ELEM_THREADS)
bf16_to_f32_copy(const bf16_t* __restrict__ a, float* __restrict__ out, long long n) {
    pdl_enter();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        out[i] = bf16_to_f32(a[i]);
}

// out[t, h] = bf16(sum_k wts[t, k] * routed[row(t, k), h] + shared[t, h]); grid (H / (threads * 8), T).
template <bool INDEXED>
__device__ __forceinline__ void combine(const bf16_t* routed, const float* wts, const int* perm,
                                        const bf16_t* shared, bf16_t* out, int H, int K) {
    const int t = blockIdx.y;
    const int h0 = (blockIdx.x * COMBINE_THREADS + threadIdx.x) * COMBINE_VEC;
    if (h0 >= H) return;
    float acc[COMBINE_VEC];
#pragma unroll
    for (int j = 0; j < COMBINE_VEC; ++j) acc[j] = 0.0f;
    for (int k = 0; k < K; ++k) {
        const float w = wts[t * K + k];
        const long long row = INDEXED ? perm[t * K + k] : t * K + k;
        const uint4 v = ld_cached_v4(routed + row * H + h0);
        const unsigned pair[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            acc[2 * j] = __fadd_rn(acc[2 * j], __fmul_rn(w, bf16_lo(pair[j])));
            acc[2 * j + 1] = __fadd_rn(acc[2 * j + 1], __fmul_rn(w, bf16_hi(pair[j])));
        }
    }
    if (shared) {
        const uint4 v = ld_cached_v4(shared + (long long)t * H + h0);
        const unsigned pair[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            acc[2 * j] = __fadd_rn(acc[2 * j], bf16_lo(pair[j]));
            acc[2 * j + 1] = __fadd_rn(acc[2 * j + 1], bf16_hi(pair[j]));
        }
    }
    uint4 o;
    o.x = f32_to_bf16(acc[0]) | ((unsigned)f32_to_bf16(acc[1]) << 16);
    o.y = f32_to_bf16(acc[2]) | ((unsigned)f32_to_bf16(acc[3]) << 16);
    o.z = f32_to_bf16(acc[4]) | ((unsigned)f32_to_bf16(acc[5]) << 16);
    o.w = f32_to_bf16(acc[6]) | ((unsigned)f32_to_bf16(acc[7]) << 16);
    *(uint4*)(out + (long long)t * H + h0) = o;
}

// `shared` may be null (no shared expert on this rank).
extern "C" __global__ void __launch_bounds__(COMBINE_THREADS)
moe_combine(const bf16_t* __restrict__ routed, const float* __restrict__ wts, const bf16_t* shared,
            bf16_t* __restrict__ out, int H, int K) {
    pdl_enter();
    combine<false>(routed, wts, nullptr, shared, out, H, K);
}

// Slot (t, k) read from routed[perm[t, k]] (the expert-sorted order of the grouped prefill).
extern "C" __global__ void __launch_bounds__(COMBINE_THREADS)
moe_combine_indexed(const bf16_t* __restrict__ routed, const int* __restrict__ perm, const float* __restrict__ wts,
                    const bf16_t* shared, bf16_t* __restrict__ out, int H, int K) {
    pdl_enter();
    combine<true>(routed, wts, perm, shared, out, H, K);
}
