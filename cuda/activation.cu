// activation.cu: SiLU-and-multiply over the fused gate/up projection.
// x [T, 2I] = (gate | up) -> out [T, I] = silu(gate) * up, computed in float32.
// Launch: grid (ceil(I / (VEC * blockDim)) or ceil(I / blockDim), min(T, 65535)), the
// y dimension strides over rows.  vec_ok = 1 when I % VEC == 0 and pointers are 16-byte
// aligned (then each thread handles one 16-byte vector of gate and of up).
//
// History (H200, 4096 x 28672 bf16, bench; % of copy bandwidth):
//   v1  (this) expf + IEEE division ........................................... 77%
//   v2  ex2.approx + rcp.rn (about half the instructions): 77% -- not issue-bound, so
//       no gain; reverted for the exact path (2026-11-30, commit 1e34cd6).
//
// silu_and_mul_fp8_kernel: one CTA per row (the row's amax is a block reduction, so the
// row cannot be spread over CTAs as above): each thread keeps its first SILU_VPT vectors of
// silu(gate) * up (rounded to the dtype) in registers, a longer row's tail is recomputed;
// then e4m3 codes q[t, :] = sat(v * 448 / amax) and scale[t] = amax / 448 (fp8.cuh).
// The values are silu_and_mul_kernel's, bit for bit.  At I = 14336 (bf16) one row is
// 1792 16-byte vectors of gate and as many of up: 448 threads x 4 in registers.
// Launch: grid min(T, 65535), block ceil(I / VEC / SILU_VPT) (vec_ok) or ceil(I /
// SILU_VPT), rounded up to a warp multiple, between 32 and 512.
// History (H100, graph-timed, 14336-wide rows, bf16 -> e4m3; % of copy bandwidth):
//   v1  float register cache, 89 registers: one 448-thread CTA per SM, so a row's loads,
//       its amax reduction and its stores ran in turn with nothing beside them .. 52 / 54%
//       (4,096 / 512 rows)
//   v2  (this) the cache packed as dtype pairs (quantize_row), bounded to 2 CTAs per SM
//       (58 registers) ............................................. 79.2 / 77.9% (2026-12-07)
#include "common.cuh"
#include "fp8.cuh"

#define SILU_VPT 4

__device__ __forceinline__ float silu_mul(float g, float u) { return g / (1.f + expf(-g)) * u; }

extern "C" __global__ void silu_and_mul_kernel(const scalar_t* __restrict__ x,
                                               scalar_t* __restrict__ out, int T, int I,
                                               int vec_ok) {
    for (int t = blockIdx.y; t < T; t += gridDim.y) {
        const scalar_t* gate = x + (long long)t * 2 * I;
        const scalar_t* up = gate + I;
        scalar_t* dst = out + (long long)t * I;
        if (vec_ok) {
            const int i = (blockIdx.x * blockDim.x + threadIdx.x) * VEC;
            if (i < I) {
                float g[VEC], u[VEC], o[VEC];
                load_vec<VEC>(gate + i, g);
                load_vec<VEC>(up + i, u);
#pragma unroll
                for (int k = 0; k < VEC; ++k) o[k] = silu_mul(g[k], u[k]);
                store_vec<VEC>(dst + i, o);
            }
        } else {
            const int i = blockIdx.x * blockDim.x + threadIdx.x;
            if (i < I) dst[i] = from_float(silu_mul(to_float(gate[i]), to_float(up[i])));
        }
    }
}

// q [T, I] e4m3 codes, q_scale [T] float32 of silu(gate) * up.  (512 threads at most:
// llmc.cuda.fp8_ops) two CTAs per SM: <= 64 registers (58 with quantize_row's packed cache).
extern "C" __global__ void __launch_bounds__(512, 2)
silu_and_mul_fp8_kernel(const scalar_t* __restrict__ x, fp8_t* __restrict__ q,
                        float* __restrict__ q_scale, int T, int I, int vec_ok) {
    __shared__ float scratch[33];
    for (int t = blockIdx.x; t < T; t += gridDim.x) {
        const scalar_t* gate = x + (long long)t * 2 * I;
        const scalar_t* up = gate + I;
        fp8_t* qrow = q + (long long)t * I;
        // the values silu_and_mul_kernel stores: rounded to the dtype
        if (vec_ok) {
            const auto vec = [&](int, int i, float* v) {
                float u[VEC];
                load_vec<VEC>(gate + i * VEC, v);
                load_vec<VEC>(up + i * VEC, u);
#pragma unroll
                for (int e = 0; e < VEC; ++e) v[e] = to_float(from_float(silu_mul(v[e], u[e])));
            };
            quantize_row<SILU_VPT, VEC>(vec, I / VEC, qrow, q_scale + t, scratch);
        } else {
            const auto one = [&](int, int i, float* v) {
                v[0] = to_float(from_float(silu_mul(to_float(gate[i]), to_float(up[i]))));
            };
            quantize_row<SILU_VPT, 1>(one, I, qrow, q_scale + t, scratch);
        }
    }
}
