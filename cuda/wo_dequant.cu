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

// wo_rows_wide<R> (dequantize only, ids = nullptr): the same values as wo_rows_kernel's
// vec path with more bytes in flight a thread: R rows x 32 columns (four 8-column units;
// int4: one 16-byte code load a row, int8: two), every load of the R rows issued before
// the first store. Requirements: K % 32 == 0, gs % 8 == 0, code rows and output rows
// 16-byte aligned. Grid (ceil(K / (32 * blockDim.x)), ceil(T / R)), any block of whole warps.
template <int R>
__device__ __forceinline__ void wo_rows_wide_body(const unsigned char* __restrict__ codes,
                                                  const void* __restrict__ scales,
                                                  const void* __restrict__ offsets,
                                                  scalar_t* __restrict__ out, int T, int K,
                                                  int bits, int code_zero, int gs, int G,
                                                  int flags) {
    const bool f32 = (flags & 1) != 0, has_o = offsets != nullptr;
    const int c0 = 32 * (blockIdx.x * blockDim.x + threadIdx.x);
    if (c0 >= K) return;
    const long long rowbytes = bits == 4 ? K / 2 : K;
    const int t0 = blockIdx.y * R;
    v4u w[R][2];
    float s[R][4], o[R][4];
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const int t = min(t0 + r, T - 1);  // past T: row T - 1 again, never stored
        const unsigned char* row = codes + t * rowbytes + c0 * bits / 8;
        w[r][0] = *reinterpret_cast<const v4u*>(row);
        w[r][1] = bits == 8 ? *reinterpret_cast<const v4u*>(row + 16) : v4u{0u, 0u, 0u, 0u};
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            const long long gi = (long long)t * G + (c0 + 8 * u) / gs;
            s[r][u] = wod_scale(scales, gi, f32);
            o[r][u] = has_o ? wod_scale(offsets, gi, f32) : 0.f;
        }
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
        if (t0 + r >= T) break;
        const unsigned int word[8] = {w[r][0].x, w[r][0].y, w[r][0].z, w[r][0].w,
                                      w[r][1].x, w[r][1].y, w[r][1].z, w[r][1].w};
        scalar_t* dst = out + (long long)(t0 + r) * K + c0;
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            unsigned int q[8];
#pragma unroll
            for (int e = 0; e < 8; ++e)
                q[e] = bits == 4 ? (word[u] >> (4 * e)) & 15u
                                 : (word[2 * u + (e >> 2)] >> (8 * (e & 3))) & 255u;
            float f[8];
            wod_values8(q, s[r][u], o[r][u], has_o, code_zero, f);
            store_vec<8>(dst + 8 * u, f);
        }
    }
}

#define WO_ROWS_WIDE(R)                                                                        \
    extern "C" __global__ void wo_rows_wide##R(                                                \
        const unsigned char* __restrict__ codes, const void* __restrict__ scales,              \
        const void* __restrict__ offsets, scalar_t* __restrict__ out, int T, int K, int bits,  \
        int code_zero, int gs, int G, int flags) {                                             \
        wo_rows_wide_body<R>(codes, scales, offsets, out, T, K, bits, code_zero, gs, G, flags); \
    }
WO_ROWS_WIDE(1)
WO_ROWS_WIDE(2)
WO_ROWS_WIDE(4)
