// embedding.cu: token embedding gather.  out[t, :] = table[ids[t], :].
// ids outside [0, V) (e.g. CUDA-graph padding rows) produce a zero row instead of
// reading out of bounds.  Launch: grid (min(T, 65535)), block 128..1024; vec_ok = 1 when
// H * sizeof(scalar_t) % 16 == 0 and both base pointers are 16-byte aligned.
#include "common.cuh"
#include "pdl.cuh"

extern "C" __global__ void embedding_kernel(const long long* __restrict__ ids,
                                            const scalar_t* __restrict__ table,
                                            scalar_t* __restrict__ out, int T, int H,
                                            long long V, int vec_ok) {
    pdl_trigger();  // the first layer's qkv GEMV may launch and start its weight stream
    for (int t = blockIdx.x; t < T; t += gridDim.x) {
        const long long id = ids[t];
        const bool valid = id >= 0 && id < V;
        const scalar_t* src = table + (valid ? id : 0) * (long long)H;
        scalar_t* dst = out + (long long)t * H;
        if (vec_ok) {
            const int nv = H / VEC;
            for (int i = threadIdx.x; i < nv; i += blockDim.x) {
                v4u v = valid ? reinterpret_cast<const v4u*>(src)[i] : v4u{0u, 0u, 0u, 0u};
                reinterpret_cast<v4u*>(dst)[i] = v;
            }
        } else {
            for (int i = threadIdx.x; i < H; i += blockDim.x) {
                dst[i] = valid ? src[i] : (scalar_t)0;
            }
        }
    }
}
