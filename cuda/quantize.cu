// quantize.cu: per-row dynamic e4m3 quantization of an activation, one CTA per row.
//   x [T, K] (the dtype) -> q [T, K] e4m3 codes, q_scale [T] float32
//   amax = max(max|x_row|, 1e-12), q = sat(x * 448 / amax), scale = amax / 448 (fp8.cuh;
//   llmc.cuda.reference_fp8.quantize_fp8, bit for bit).
// The attention output feeding o_proj: vLLM also quantizes it in a separate pass for
// dynamic per-token scales.  Fusing it into the attention epilogue needs the row's amax
// across all query heads, i.e. across the CTAs of the kv heads (a follow-up).
// The row is read once: QUANT_VPT 16-byte vectors per thread stay in registers (K = 4096
// bf16 is 512 vectors: 128 threads x 4); a longer row's tail is read again (L1/L2).
// vec_ok = 1 when K % VEC == 0 and x, q are 16-byte aligned; otherwise a scalar path.
// Launch: grid min(T, 65535), block ceil(K / VEC / QUANT_VPT) (vec_ok) or ceil(K /
// QUANT_VPT), rounded up to a warp multiple, between 32 and 1024.
#include "common.cuh"
#include "fp8.cuh"

#define QUANT_VPT 4

extern "C" __global__ void quantize_fp8_kernel(const scalar_t* __restrict__ x,
                                               fp8_t* __restrict__ q,
                                               float* __restrict__ q_scale, int T, int K,
                                               int vec_ok) {
    __shared__ float scratch[33];
    for (int t = blockIdx.x; t < T; t += gridDim.x) {
        const scalar_t* row = x + (long long)t * K;
        fp8_t* qrow = q + (long long)t * K;
        if (vec_ok) {
            const auto vec = [&](int, int i, float* v) { load_vec<VEC>(row + i * VEC, v); };
            quantize_row<QUANT_VPT, VEC>(vec, K / VEC, qrow, q_scale + t, scratch);
        } else {
            const auto one = [&](int, int i, float* v) { v[0] = to_float(row[i]); };
            quantize_row<QUANT_VPT, 1>(one, K, qrow, q_scale + t, scratch);
        }
    }
}
