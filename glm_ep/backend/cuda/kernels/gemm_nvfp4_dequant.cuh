// nvfp4_dequant_bf16: one expert's NVFP4 projection as exact bf16, for the dequant path. Part of gemm_nvfp4.cu,
// included at its end: it uses dequant_word and scale_pair from there (glm_ep/backend/cuda/kernel_loader.py inlines it).
//
// NumPy twin: NumpyBackend.dequant_linear (glm_ep/backend/numpy_backend.py; glm_ep/checkpoint/nvfp4.py's
// dequantize_unscaled); held together by
// tests/cuda/test_cuda_gemm.py::test_dequant_bf16_bit_exact_and_dequant_linear and
// test_dequant_bf16_ragged_and_grid_stride.
#pragma once

// One expert's projection [N, K] as bf16 w[n, k] = e2m1[n, k] * e4m3[n, k / 16], exact (dequant_word with the
// block scale pair as e4m3 itself: at most 6 significant bits), for a bf16 GEMM that applies scale_2 to its fp32 sums
// (a dense FFN stored NVFP4 at compute-bound widths). A thread per 32-bit word of packed weights (8 k; words 2i and
// 2i + 1 share block scale i) and its 16 output bytes, so a warp's loads and stores are each one contiguous run;
// four words a thread in flight (a warp sweeps 128 words a round).
extern "C" __global__ void __launch_bounds__(256) nvfp4_dequant_bf16(const unsigned* __restrict__ packed,
                                                                     const unsigned char* __restrict__ scale,
                                                                     uint4* __restrict__ out, long long words) {
    pdl_enter();  // the GEMM before this launch may still read `out`
    const long long warps = (long long)gridDim.x * blockDim.x / 32;
    const int lane = threadIdx.x & 31;
    for (long long w0 = ((long long)blockIdx.x * blockDim.x + threadIdx.x) / 32 * 128; w0 < words; w0 += warps * 128) {
        unsigned q[4], s[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const long long i = w0 + 32 * j + lane;
            q[j] = i < words ? packed[i] : 0u;
            s[j] = i < words ? scale[i >> 1] : 0u;
        }
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const long long i = w0 + 32 * j + lane;
            if (i >= words) break;
            unsigned b[4];
            dequant_word(q[j], scale_pair(s[j], 256.0f), b);  // the scale as e4m3 itself
            out[i] = make_uint4(b[0], b[1], b[2], b[3]);
        }
    }
}
