// cp.async helpers (sm_80+) shared by the kernels that stage global memory in shared memory
// (gemv_nvfp4_ring.cu, gemm_nvfp4.cu). Include after common.cuh.
//
// NumPy twin: none (copies only); what it stages is checked through the kernels that use it; held together by
// tests/cuda/test_cuda_ring.py, test_cuda_union.py, test_cuda_gemm.py and test_cuda_dense.py (the warp-streaming
// GEMM).
#pragma once

__device__ __forceinline__ unsigned smem_u32(const void* p) {
    unsigned a;
    asm("{\n\t.reg .u64 t;\n\tcvta.to.shared.u64 t, %1;\n\tcvt.u32.u64 %0, t;\n\t}" : "=r"(a) : "l"(p));
    return a;
}

__device__ __forceinline__ void cp_async16(unsigned dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
}

// 16 bytes, or 16 zero bytes where !valid (src is then not read but must still be a global address).
__device__ __forceinline__ void cp_async16_zfill(unsigned dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0)
                 : "memory");
}

// 4 bytes, or 4 zero bytes where !valid.
__device__ __forceinline__ void cp_async4_zfill(unsigned dst, const void* src, bool valid) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(dst), "l"(src), "r"(valid ? 4 : 0)
                 : "memory");
}

// 8 bytes, or 8 zero bytes where !valid.
__device__ __forceinline__ void cp_async8_zfill(unsigned dst, const void* src, bool valid) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;" ::"r"(dst), "l"(src), "r"(valid ? 8 : 0)
                 : "memory");
}

// The same three copies with an L2 prefetch of the 128-byte block around the source (.L2::128B): a stream that
// reads a few bytes of each of many rows a stage (the grouped GEMM's 32-byte weight pieces and 4-byte scale words
// of 128 rows) has the next stages' bytes of the same rows fetched from DRAM in one request.
__device__ __forceinline__ void cp_async16_zfill_pf(unsigned dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0)
                 : "memory");
}

__device__ __forceinline__ void cp_async4_zfill_pf(unsigned dst, const void* src, bool valid) {
    asm volatile("cp.async.ca.shared.global.L2::128B [%0], [%1], 4, %2;" ::"r"(dst), "l"(src), "r"(valid ? 4 : 0)
                 : "memory");
}

__device__ __forceinline__ void cp_async8_zfill_pf(unsigned dst, const void* src, bool valid) {
    asm volatile("cp.async.ca.shared.global.L2::128B [%0], [%1], 8, %2;" ::"r"(dst), "l"(src), "r"(valid ? 8 : 0)
                 : "memory");
}

// One of the six copies above, by its size (4, 8 or 16 bytes) and whether it prefetches into L2, both known at
// compile time (a stage's scale bytes are BK / 16 of a row; an engine prefetches or does not).
template <int BYTES, bool PF>
__device__ __forceinline__ void cp_async_zfill(unsigned dst, const void* src, bool valid) {
    static_assert(BYTES == 4 || BYTES == 8 || BYTES == 16, "cp.async copies 4, 8 or 16 bytes");
    if constexpr (BYTES == 16 && PF)
        cp_async16_zfill_pf(dst, src, valid);
    else if constexpr (BYTES == 16)
        cp_async16_zfill(dst, src, valid);
    else if constexpr (BYTES == 8 && PF)
        cp_async8_zfill_pf(dst, src, valid);
    else if constexpr (BYTES == 8)
        cp_async8_zfill(dst, src, valid);
    else if constexpr (PF)
        cp_async4_zfill_pf(dst, src, valid);
    else
        cp_async4_zfill(dst, src, valid);
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}
