// activation.cu: SiLU-and-multiply over the fused gate/up projection.
// x [T, 2I] = (gate | up) -> out [T, I] = silu(gate) * up, computed in float32.
// Launch: grid (ceil(I / (VEC * blockDim)) or ceil(I / blockDim), min(T, 65535)), the
// y dimension strides over rows.  vec_ok = 1 when I % VEC == 0 and pointers are 16-byte
// aligned (then each thread handles one 16-byte vector of gate and of up).
//
// History (H200, 4096 x 28672 bf16; % of copy bandwidth):
//   v1  expf + IEEE division per element .................................... 77%
//   v2  ex2.approx + rcp.rn (about half the instructions per element)
#include "common.cuh"

// silu(g) * u = g * u / (1 + e^-g): fast exp (ex2.approx) and IEEE reciprocal (PTX); for
// g < -88, e^-g = inf and the reciprocal is 0 (the exact result underflows too).
__device__ __forceinline__ float silu_mul(float g, float u) {
    float e, r;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(g * -1.4426950408889634f));
    asm("rcp.rn.f32 %0, %1;" : "=f"(r) : "f"(1.f + e));
    return g * u * r;
}

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
