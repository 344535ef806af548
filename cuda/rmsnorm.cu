// rmsnorm.cu: RMSNorm and fused residual-add + RMSNorm, one CTA per row.
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
// History (H200, 16384 x 4096 bf16, bench; % of copy bandwidth, rms_norm / add_rms_norm):
//   v1  (this) weight read after the block reduction ........................ 69% / 79%
//   v2  weight vectors loaded with the row before the reduction, row and weight kept
//       packed in registers (66 -> 54 registers): 60% / 74% -- slower; reverted
//       (2026-11-30, commit 1e34cd6).
#include "common.cuh"

#define RMS_VPT 4

extern "C" __global__ void rms_norm_kernel(const scalar_t* __restrict__ x,
                                           scalar_t* __restrict__ residual,
                                           const scalar_t* __restrict__ w,
                                           scalar_t* __restrict__ out, int T, int H, float eps,
                                           int has_residual, int vec_ok) {
    __shared__ float scratch[33];
    for (int t = blockIdx.x; t < T; t += gridDim.x) {
        const scalar_t* xr = x + (long long)t * H;
        scalar_t* rr = has_residual ? residual + (long long)t * H : nullptr;
        scalar_t* orow = out + (long long)t * H;
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
#pragma unroll
            for (int k = 0; k < RMS_VPT; ++k) {
                const int i = threadIdx.x + k * blockDim.x;
                if (i < nv) {
                    float wv[VEC], o[VEC];
                    load_vec<VEC>(w + i * VEC, wv);
#pragma unroll
                    for (int e = 0; e < VEC; ++e) o[e] = cache[k][e] * scale * wv[e];
                    store_vec<VEC>(orow + i * VEC, o);
                }
            }
            const scalar_t* src = has_residual ? rr : xr;
            for (int i = threadIdx.x + RMS_VPT * blockDim.x; i < nv; i += blockDim.x) {
                float v[VEC], wv[VEC];
                load_vec<VEC>(src + i * VEC, v);
                load_vec<VEC>(w + i * VEC, wv);
#pragma unroll
                for (int e = 0; e < VEC; ++e) v[e] = v[e] * scale * wv[e];
                store_vec<VEC>(orow + i * VEC, v);
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
            for (int i = threadIdx.x; i < H; i += blockDim.x) {
                orow[i] = from_float(to_float(src[i]) * scale * to_float(w[i]));
            }
        }
    }
}
