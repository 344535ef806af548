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
#include "common.cuh"

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
