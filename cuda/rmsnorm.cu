// rmsnorm.cu: RMSNorm and fused residual-add + RMSNorm, one CTA per row; the FP8 variant
// quantizes the normed row in its epilogue (no second pass over the activation).
//   has_residual = 0: out = x / rms(x) * w
//   has_residual = 1: residual = x + residual (rounded to the dtype, stored in place), then
//                     out = residual / rms(residual) * w
// rms is computed in float32 over the stored (rounded) values, matching torch's
// `residual += x; rms_norm(residual)`.  The row is read from device memory once: up to
// RMS_VPT 16-byte vectors per thread stay in registers between the two passes; longer
// rows re-read the tail (L1/L2 hits).  vec_ok = 1 when H % VEC == 0 and pointers are
// 16-byte aligned; otherwise a scalar path runs.  Launch: grid min(T, 65535), block
// ceil(H / VEC / RMS_VPT) rounded up to a warp multiple (<= 1024).
//
// rms_norm_fp8_kernel: the same row pass (same block size -> the same float32 sums, so the
// same normed values, bit for bit), then each normed value is rounded to the dtype, the
// row's amax taken over those (a block max), and e4m3 codes q[t, :] = sat(v * 448 / amax)
// and scale[t] = amax / 448 written (fp8.cuh; llmc.cuda.reference_fp8.rms_norm_fp8 ==
// quantize_fp8(rms_norm(x))).  The first RMS_VPT vectors of a thread stay in registers;
// a longer row's tail is recomputed from x (or the stored residual) and w.
//
// History (H200, 16384 x 4096 bf16, bench; % of copy bandwidth, rms_norm / add_rms_norm):
//   v1  (this) weight read after the block reduction ........................ 69% / 79%
//   v2  weight vectors loaded with the row before the reduction, row and weight kept
//       packed in registers (66 -> 54 registers): 60% / 74% -- slower; reverted
//       (2026-11-30, commit 1e34cd6).
#include "common.cuh"
#include "fp8.cuh"

#define RMS_VPT 4

// Normed value of element e of vector i of the row (src: x, or the updated residual).
__device__ __forceinline__ float rms_value(float v, float scale, float w) { return v * scale * w; }

// One row: the residual update, the float32 sum of squares and the normed output, written
// as the dtype (FP8 = false) or as e4m3 codes + the row scale (FP8 = true).
template <bool FP8>
__device__ __forceinline__ void rms_row(const scalar_t* __restrict__ xr, scalar_t* __restrict__ rr,
                                        const scalar_t* __restrict__ w, scalar_t* __restrict__ orow,
                                        fp8_t* __restrict__ qrow, float* __restrict__ qscale,
                                        int H, float eps, int has_residual, int vec_ok,
                                        float* scratch) {
    float ss = 0.f;
    if (vec_ok) {
        const int nv = H / VEC;
        float cache[RMS_VPT][VEC];
#pragma unroll
        for (int k = 0; k < RMS_VPT; ++k) {
            const int i = threadIdx.x + k * blockDim.x;
            if (i < nv) {
                load_vec<VEC>(xr + i * VEC, cache[k]);
                if (has_residual) {
                    float r[VEC];
                    load_vec<VEC>(rr + i * VEC, r);
#pragma unroll
                    for (int e = 0; e < VEC; ++e)
                        cache[k][e] = to_float(from_float(cache[k][e] + r[e]));
                    store_vec<VEC>(rr + i * VEC, cache[k]);
                }
#pragma unroll
                for (int e = 0; e < VEC; ++e) ss += cache[k][e] * cache[k][e];
            }
        }
        for (int i = threadIdx.x + RMS_VPT * blockDim.x; i < nv; i += blockDim.x) {
            float v[VEC];
            load_vec<VEC>(xr + i * VEC, v);
            if (has_residual) {
                float r[VEC];
                load_vec<VEC>(rr + i * VEC, r);
#pragma unroll
                for (int e = 0; e < VEC; ++e) v[e] = to_float(from_float(v[e] + r[e]));
                store_vec<VEC>(rr + i * VEC, v);
            }
#pragma unroll
            for (int e = 0; e < VEC; ++e) ss += v[e] * v[e];
        }
        const float scale = rsqrtf(block_sum(ss, scratch) / (float)H + eps);
        const scalar_t* src = has_residual ? rr : xr;
        if constexpr (!FP8) {
#pragma unroll
            for (int k = 0; k < RMS_VPT; ++k) {
                const int i = threadIdx.x + k * blockDim.x;
                if (i < nv) {
                    float wv[VEC], o[VEC];
                    load_vec<VEC>(w + i * VEC, wv);
#pragma unroll
                    for (int e = 0; e < VEC; ++e) o[e] = rms_value(cache[k][e], scale, wv[e]);
                    store_vec<VEC>(orow + i * VEC, o);
                }
            }
            for (int i = threadIdx.x + RMS_VPT * blockDim.x; i < nv; i += blockDim.x) {
                float v[VEC], wv[VEC];
                load_vec<VEC>(src + i * VEC, v);
                load_vec<VEC>(w + i * VEC, wv);
#pragma unroll
                for (int e = 0; e < VEC; ++e) v[e] = rms_value(v[e], scale, wv[e]);
                store_vec<VEC>(orow + i * VEC, v);
            }
        } else {
            // the first RMS_VPT vectors from the registers, the tail from memory again
            const auto normed = [&](int k, int i, float* v) {
                float wv[VEC];
                load_vec<VEC>(w + i * VEC, wv);
                if (k >= 0) {
#pragma unroll
                    for (int e = 0; e < VEC; ++e) v[e] = cache[k][e];
                } else {
                    load_vec<VEC>(src + i * VEC, v);
                }
#pragma unroll
                for (int e = 0; e < VEC; ++e) v[e] = to_float(from_float(rms_value(v[e], scale, wv[e])));
            };
            quantize_row<RMS_VPT, VEC>(normed, nv, qrow, qscale, scratch);
        }
    } else {
        for (int i = threadIdx.x; i < H; i += blockDim.x) {
            float v = to_float(xr[i]);
            if (has_residual) {
                scalar_t s = from_float(v + to_float(rr[i]));
                rr[i] = s;
                v = to_float(s);
            }
            ss += v * v;
        }
        const float scale = rsqrtf(block_sum(ss, scratch) / (float)H + eps);
        const scalar_t* src = has_residual ? rr : xr;
        if constexpr (!FP8) {
            for (int i = threadIdx.x; i < H; i += blockDim.x)
                orow[i] = from_float(rms_value(to_float(src[i]), scale, to_float(w[i])));
        } else {
            const auto one = [&](int, int i, float* v) {
                v[0] = to_float(from_float(rms_value(to_float(src[i]), scale, to_float(w[i]))));
            };
            quantize_row<1, 1>(one, H, qrow, qscale, scratch);
        }
    }
}

extern "C" __global__ void rms_norm_kernel(const scalar_t* __restrict__ x,
                                           scalar_t* __restrict__ residual,
                                           const scalar_t* __restrict__ w,
                                           scalar_t* __restrict__ out, int T, int H, float eps,
                                           int has_residual, int vec_ok) {
    __shared__ float scratch[33];
    for (int t = blockIdx.x; t < T; t += gridDim.x) {
        rms_row<false>(x + (long long)t * H, has_residual ? residual + (long long)t * H : nullptr,
                       w, out + (long long)t * H, nullptr, nullptr, H, eps, has_residual, vec_ok,
                       scratch);
    }
}

// q [T, H] e4m3 codes, q_scale [T] float32 (rows as rms_norm_kernel's, launched the same).
extern "C" __global__ void rms_norm_fp8_kernel(const scalar_t* __restrict__ x,
                                               scalar_t* __restrict__ residual,
                                               const scalar_t* __restrict__ w,
                                               fp8_t* __restrict__ q, float* __restrict__ q_scale,
                                               int T, int H, float eps, int has_residual,
                                               int vec_ok) {
    __shared__ float scratch[33];
    for (int t = blockIdx.x; t < T; t += gridDim.x) {
        rms_row<true>(x + (long long)t * H, has_residual ? residual + (long long)t * H : nullptr,
                      w, nullptr, q + (long long)t * H, q_scale + t, H, eps, has_residual, vec_ok,
                      scratch);
    }
}
