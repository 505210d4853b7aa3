// Shared device helpers of the glm_ep kernels. Self-contained: no system or CUDA headers, so
// NVRTC compiles it as is (glm_ep/backend/cuda/kernel_loader.py inlines it where a .cu includes it).
//
// Numerics: bf16 <-> f32 by bit manipulation (widen = bits << 16; narrow = round to nearest
// even, NaN kept quiet).
//
// NumPy twin: ml_dtypes' bf16 rounding (what the NumPy side rounds with) and NumpyBackend.swiglu for swiglu_one
// (glm_ep/backend/numpy_backend.py); held together by tests/cuda/test_cuda_elementwise.py; pdl_enter's place in
// every kernel by
// tests/cuda/test_kernels_build.py::test_every_kernel_waits_for_its_predecessor_before_touching_memory.
#pragma once

typedef unsigned short bf16_t;  // raw bf16 bits
typedef unsigned long long u64_t;

// The one dynamic shared-memory window of every kernel (each casts it to what it stages).
extern __shared__ __align__(16) unsigned char dyn_smem[];

// Programmatic dependent launch (sm_90 and later). Every kernel calls this first, before it reads
// or writes global memory: it waits until the grid it depends on has finished and its writes are
// visible, then lets the next grid on the stream place its blocks, which wait here in turn. The
// loader launches with the attribute where the backend's `pdl` lever is on (the persistent rings
// excepted); without it both instructions return at once, so the kernels are the same either way.
__device__ __forceinline__ void pdl_enter() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ float bf16_to_f32(unsigned bits) {
    return __uint_as_float((bits & 0xffffu) << 16);
}

// The low / high bf16 of a packed pair, widened.
__device__ __forceinline__ float bf16_lo(unsigned pair) { return __uint_as_float(pair << 16); }
__device__ __forceinline__ float bf16_hi(unsigned pair) { return __uint_as_float(pair & 0xffff0000u); }

__device__ __forceinline__ bf16_t f32_to_bf16(float f) {
    unsigned u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16_t)((u >> 16) | 0x40u);  // NaN stays NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16_t)(u >> 16);
}

__device__ __forceinline__ float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

// A packed pair of fp16 widened to fp32.
__device__ __forceinline__ void f16x2_to_f32(unsigned h2, float& lo, float& hi) {
    asm("{\n\t.reg .b16 l, h;\n\tmov.b32 {l, h}, %2;\n\tcvt.f32.f16 %0, l;\n\tcvt.f32.f16 %1, h;\n\t}"
        : "=f"(lo), "=f"(hi) : "r"(h2));
}

// Streaming loads of weights (read once: keep them out of L1) and cached loads of activations.
// Not volatile: they read memory no kernel writes while it runs, so the compiler may schedule them.
// Under programmatic dependent launch the previous kernel may still be writing an activation when
// this one's blocks start, so every load must stay after pdl_enter()'s wait: the loads sit in the
// kernels' bodies behind it, and tests/test_kernels_build.py checks each entry's PTX for the order.
__device__ __forceinline__ uint4 ld_stream_v4(const void* p) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

__device__ __forceinline__ unsigned ld_stream_u16(const void* p) {
    unsigned short v;
    asm("ld.global.nc.L1::no_allocate.u16 %0, [%1];" : "=h"(v) : "l"(p));
    return v;
}

__device__ __forceinline__ uint4 ld_cached_v4(const void* p) {
    uint4 v;
    asm("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// The inclusive prefix sum of v over lanes 0 .. lane (all 32 lanes take part).
__device__ __forceinline__ int warp_inclusive_sum(int v) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int u = __shfl_up_sync(0xffffffffu, v, o);
        if (lane >= o) v += u;
    }
    return v;
}

// The clamped asymmetric SwiGLU of one element, on bf16 inputs: silu(min(g, L)) * clamp(u, -L, L)
// in fp32, rounded once to bf16. NaN inputs propagate (the comparisons keep them).
__device__ __forceinline__ bf16_t swiglu_one(float g, float u, float limit) {
    g = (g > limit) ? limit : g;
    u = (u > limit) ? limit : ((u < -limit) ? -limit : u);
    const float silu = g / (1.0f + expf(-g));
    return f32_to_bf16(__fmul_rn(silu, u));
}
