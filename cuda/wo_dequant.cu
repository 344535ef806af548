// wo_dequant.cu: rows of a weight-only quantized matrix (llmc.cuda.reference_wo.PackedWeight)
// dequantized into the activation dtype, bit-exact to PackedWeight.dequantize rounded once:
//   w[n, k] = fl32(fl32(s[n, g] * float(q[n, k] - code_zero)) + o[n, g]),  g = k / gs
// (__fmul_rn / __fadd_rn: never contracted into an FMA; wo_dequant.cuh), then from_float.
//
// One kernel, two uses:
//   embedding   out[t, :] = dequantize(row ids[t]) (ids outside [0, V): a zero row, as
//               embedding.cu; e.g. CUDA-graph padding rows);
//   dequantize  ids = nullptr: out[n, :] = dequantize(row n), n < T (= N): the weight of
//               the dequantize-then-cuBLAS linear (llmc.cuda.gemv_wo_ops), in row chunks.
// codes [V, K / 2] (4-bit, even k in the low nibble) or [V, K] (8-bit); scales / offsets
// [V, G] f16 or f32 (flags & 1: f32), offsets optional.
//
// Launch: grid (ceil(K / (8 * 256)) or ceil(K / 256), min(T, 65535)), block 256; vec = 1
// when K % 8 == 0, gs % 8 == 0 and the output base is 16-byte aligned (each thread then
// writes 8 columns of one group with one 16-byte store), else one column per thread.
#include "wo_dequant.cuh"

extern "C" __global__ void wo_rows_kernel(const long long* __restrict__ ids,
                                          const unsigned char* __restrict__ codes,
                                          const void* __restrict__ scales,
                                          const void* __restrict__ offsets,
                                          scalar_t* __restrict__ out, int T, int K, long long V,
                                          int bits, int code_zero, int gs, int G, int flags,
                                          int vec) {
    const bool f32 = (flags & 1) != 0;
    const long long rowbytes = bits == 4 ? K / 2 : K;
    for (int t = blockIdx.y; t < T; t += gridDim.y) {
        const long long id = ids != nullptr ? ids[t] : t;
        const bool valid = id >= 0 && id < V;
        const long long n = valid ? id : 0;
        const unsigned char* row = codes + n * rowbytes;
        scalar_t* dst = out + (long long)t * K;
        if (vec) {
            const int c0 = 8 * (blockIdx.x * blockDim.x + threadIdx.x);
            if (c0 >= K) continue;
            float f[8];
            const int g = c0 / gs;
            const float s = wod_scale(scales, n * G + g, f32);
            const float o = offsets != nullptr ? wod_scale(offsets, n * G + g, f32) : 0.f;
            unsigned int q[8];
            wod_codes8(row, c0, bits, q);
            wod_values8(q, s, o, offsets != nullptr, code_zero, f);
            if (!valid) {
#pragma unroll
                for (int e = 0; e < 8; ++e) f[e] = 0.f;
            }
            store_vec<8>(dst + c0, f);
        } else {
            const int k = blockIdx.x * blockDim.x + threadIdx.x;
            if (k >= K) continue;
            const int g = k / gs;
            float v = __fmul_rn(wod_scale(scales, n * G + g, f32),
                                (float)(wod_code(row, k, bits) - code_zero));
            if (offsets != nullptr) v = __fadd_rn(v, wod_scale(offsets, n * G + g, f32));
            dst[k] = from_float(valid ? v : 0.f);
        }
    }
}
