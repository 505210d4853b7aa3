// The grouped GEMM's K split (gridDim.y > 1, for grids with fewer blocks than SMs): which share of K a block
// streams, where its fp32 partial sums go, and the second pass that adds them. Part of gemm_nvfp4.cu, included
// before its epilogues: it uses common.cuh's rounding and SwiGLU (glm_ep/backend/cuda/kernel_loader.py inlines them).
//
// NumPy twin: NumpyBackend.moe_gate_up_act_sorted and moe_gemm_sorted (glm_ep/backend/numpy_backend.py; a split
// moves no rounding point); held together by tests/cuda/test_cuda_gemm.py::test_gemm_k_split and
// tests/cuda/test_cuda_paths.py::test_nvfp4_dense_site_k_split.
#pragma once

// The block's share of K. Without a K split (gridDim.y == 1) all of it; split, block y of gridDim.y takes
// k blocks [y kb / splits, (y + 1) kb / splits) of the kb = K / BK, and its x rows, weight rows and scale
// rows are read from k0 on (the engines stream `blocks` stages from where their pointers point).
struct KSlice {
    int k0, blocks;
};

template <int BK>
__device__ __forceinline__ KSlice k_slice(int K) {
    const int kb = K / BK, y = blockIdx.y, splits = gridDim.y;
    const int b0 = (int)((long long)y * kb / splits), b1 = (int)((long long)(y + 1) * kb / splits);
    return {b0 * BK, b1 - b0};
}

// Where a split block's fp32 partial sums go: partials[(y * planes + plane) * slots + slot][n], planes = 1
// (one projection) or 2 (gate, up); nvfp4_gemm_reduce[_glu] adds the splits in order and rounds once.
__device__ __forceinline__ float* partial_row(float* partials, int planes, int plane, int slots, int slot, int N) {
    return partials + ((size_t)(blockIdx.y * planes + plane) * slots + slot) * N;
}

// The K split's second pass, one thread per 4 columns of a slot: the splits' partial sums added in split
// order (fp32), for the local experts' slots only (expert_offsets[start] <= slot < ...[start + count]:
// the sort puts them together), then rounded once (nvfp4_gemm_reduce: out = bf16(sum)) or as the
// unsplit glu rounds them (nvfp4_gemm_reduce_glu: act = swiglu(bf16(gate sum), bf16(up sum))).
__device__ __forceinline__ bool reduce_slot(const int* expert_offsets, int start, int count, int slots, int N,
                                            int& slot, int& n) {
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x, quads = N / 4;
    slot = (int)(idx / quads), n = (int)(idx % quads) * 4;
    if (expert_offsets == nullptr) return slot < slots;  // one expert, every slot
    return slot < slots && slot >= expert_offsets[start] && slot < expert_offsets[start + count];
}

__device__ __forceinline__ float4 sum_splits(const float* __restrict__ partials, int splits, int planes, int plane,
                                             int slots, int slot, int N, int n) {
    float4 s = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int y = 0; y < splits; ++y) {
        const float4 v =
            *reinterpret_cast<const float4*>(partials + ((size_t)(y * planes + plane) * slots + slot) * N + n);
        s.x += v.x, s.y += v.y, s.z += v.z, s.w += v.w;
    }
    return s;
}

extern "C" __global__ void nvfp4_gemm_reduce(const float* __restrict__ partials, int splits, int slots,
                                             const int* __restrict__ expert_offsets, int start, int count,
                                             bf16_t* __restrict__ out, int N) {
    pdl_enter();
    int slot, n;
    if (!reduce_slot(expert_offsets, start, count, slots, N, slot, n)) return;
    const float4 s = sum_splits(partials, splits, 1, 0, slots, slot, N, n);
    *reinterpret_cast<uint2*>(out + (size_t)slot * N + n) =
        make_uint2((unsigned)f32_to_bf16(s.x) | ((unsigned)f32_to_bf16(s.y) << 16),
                   (unsigned)f32_to_bf16(s.z) | ((unsigned)f32_to_bf16(s.w) << 16));
}

extern "C" __global__ void nvfp4_gemm_reduce_glu(const float* __restrict__ partials, int splits, int slots,
                                                 const int* __restrict__ expert_offsets, int start, int count,
                                                 bf16_t* __restrict__ act, int N, float limit) {
    pdl_enter();
    int slot, n;
    if (!reduce_slot(expert_offsets, start, count, slots, N, slot, n)) return;
    const float4 g = sum_splits(partials, splits, 2, 0, slots, slot, N, n);
    const float4 u = sum_splits(partials, splits, 2, 1, slots, slot, N, n);
    const float gs[4] = {g.x, g.y, g.z, g.w}, us[4] = {u.x, u.y, u.z, u.w};
    unsigned a[2] = {0, 0};
#pragma unroll
    for (int c = 0; c < 4; ++c)
        a[c >> 1] |= (unsigned)swiglu_one(round_bf16(gs[c]), round_bf16(us[c]), limit) << (16 * (c & 1));
    *reinterpret_cast<uint2*>(act + (size_t)slot * N + n) = make_uint2(a[0], a[1]);
}
