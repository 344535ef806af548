// gemv.cu: fused small-batch (M = 1..8 token rows) decode GEMVs, memory-bound on the weights.
//
// Three kernels, each instantiated for M = 1..8 (extern "C" names end in _m1 .. _m8):
//   gemv_norm_mM       out[m, n] = round(sum_k W[n, k] * xn[m, k] (+ bias[n]))
//                      xn[m] = round(x[m] * rsqrt(mean(x[m]^2) + eps) * norm_w)   (qkv)
//   gemv_norm_silu_mM  W = [2I, K] gate | up:  act[m, j] = round(round(silu(round(g))) *
//                      round(u)), g = row j, u = row I + j (norm as above)         (gate_up)
//   gemv_add_mM        residual[m, n] = round(residual[m, n] + round(sum_k W[n, k] x[m, k]))
//                                                                          (o_proj, down)
// The roundings are those of the unfused torch sequence (llmc.cuda.reference.norm_linear,
// norm_gate_up_silu, linear_residual_add); accumulation is float32.
//
// Layout of the work: a CTA is 16 warps (512 threads, one CTA per SM, grid <= SM count;
// the CTAs loop over the rows). A warp owns one *unit* of R weight rows (R = 1, 2 or 4 by
// M; for gate_up R/2 gate rows + the matching R/2 up rows) and walks K with its 32 lanes,
// lane l reading 16-byte weight vectors l, l + 32, ... of each row with
// ld.global.nc.L1::no_allocate (streamed, not kept in L1); R * U = 8 vector loads are in
// flight per thread per iteration, and each weight vector is used for all M rows. The M
// activation rows (normalised for the norm kernels) are staged once per CTA in shared
// memory as float32, in chunks of KC columns (KC = K unless M * K * 4 bytes exceeds the
// shared-memory budget, then the CTA re-stages per chunk between two barriers). For
// 16-bit dtypes a weight vector holds 8 columns; the smem row is split into two halves
// (columns 4i..4i+3 of vector i in half 0, 4i+4..4i+7 in half 1) so each lane's two
// 16-byte LDS are lane-consecutive (conflict-free). Each unit ends with a warp reduction
// (one reduce-scatter of the R * M sums when R * M >= 8, else a warp_sum each) and R * M
// lanes writing one output each.
// Units go round-robin over the CTAs first (unit = round * 16 * grid + warp * grid + CTA),
// so a last, partial round spreads over every SM. When the units fill at most half of the
// grid's warps (e.g. N = 4096 at R = 4), two warps share each unit, each over half of every
// chunk, and add their sums through shared memory after a 64-thread named barrier. Before
// the prologue (norm scales, staging), each warp prefetches the first two iterations of its
// first unit into L2, so the weight stream starts while the activations are prepared.
//
// The *_scalar kernels (K not a multiple of the 16-byte vector, or a misaligned base) run
// the same code with one element per "vector" (scalar loads): correct, slow. They are
// separate kernels so that the vector kernels keep all 128 registers without spilling.
//
// Launch: grid min(SMs, units), block 512, dynamic smem M * KC * 4 bytes; as a programmatic
// dependent launch when CudaBackend.pdl (cuda/pdl.cuh): the L2 prefetch before pdl_wait(),
// everything that reads x or writes an output after it.
//
// History: v1 (this; not yet measured on the H200).
#include "common.cuh"
#include "pdl.cuh"

#define GEMV_THREADS 512
#define GEMV_WARPS 16
#define GEMV_LOADS 8  // 16-byte weight loads in flight per thread per iteration

struct alignas(16) v4f {
    float x, y, z, w;
};

// Weight rows per warp unit: at M >= 3 one weight vector feeds R rows of FMAs per smem
// activation read (shared-memory bandwidth and issue slots stay below the HBM rate).
template <int M, int MODE>
__host__ __device__ constexpr int gemv_rows() {
    return MODE == 1 ? (M <= 4 ? 2 : 4) : (M <= 2 ? 1 : (M <= 4 ? 2 : 4));
}

// One weight vector (VW elements) as raw 32-bit words.
template <int VW>
__device__ __forceinline__ v4u load_w(const scalar_t* p) {
    v4u r;
    if constexpr (VW * (int)sizeof(scalar_t) == 16) {
        asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
            : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
            : "l"(p));
    } else {
#if LLMC_DTYPE == 0
        r.x = __float_as_uint(*p);
#else
        r.x = (unsigned int)(*p);
#endif
        r.y = r.z = r.w = 0u;
    }
    return r;
}

// Elements of a weight vector handled per step: 4 (one 16-byte smem read per m) or 1.
template <int VW>
__host__ __device__ constexpr int piece_width() {
    return VW >= 4 ? 4 : 1;
}

// Piece pc (elements pc * 4 .. pc * 4 + 3, or the one element) of a raw weight vector.
template <int VW>
__device__ __forceinline__ void unpack_w(const v4u& r, int pc, float* f) {
    if constexpr (VW * (int)sizeof(scalar_t) == 16) {
#if LLMC_DTYPE == 0
        f[0] = __uint_as_float(r.x); f[1] = __uint_as_float(r.y);
        f[2] = __uint_as_float(r.z); f[3] = __uint_as_float(r.w);
#else
        const unsigned int w0 = pc == 0 ? r.x : r.z, w1 = pc == 0 ? r.y : r.w;
        f[0] = to_float((unsigned short)(w0 & 0xffffu));
        f[1] = to_float((unsigned short)(w0 >> 16));
        f[2] = to_float((unsigned short)(w1 & 0xffffu));
        f[3] = to_float((unsigned short)(w1 >> 16));
#endif
    } else {
#if LLMC_DTYPE == 0
        f[0] = __uint_as_float(r.x);
#else
        f[0] = to_float((unsigned short)r.x);
#endif
    }
}

__device__ __forceinline__ void prefetch_l2(const void* p) {
    asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

// Barrier of the two warps (64 threads) that share a unit; ids 1..8 (0 is __syncthreads).
__device__ __forceinline__ void pair_barrier(int id) {
    asm volatile("bar.sync %0, 64;" ::"r"(id) : "memory");
}

// Shared activations: float xs[M][KC]; for VW = 8 each row is two halves (see header).
template <int VW>
__device__ __forceinline__ void smem_store(float* xs, int m, int i, int KC, const float* f) {
    if constexpr (VW == 8) {
        v4f* x4 = reinterpret_cast<v4f*>(xs) + m * (KC / 4);
        x4[i] = v4f{f[0], f[1], f[2], f[3]};
        x4[KC / 8 + i] = v4f{f[4], f[5], f[6], f[7]};
    } else if constexpr (VW == 4) {
        reinterpret_cast<v4f*>(xs)[m * (KC / 4) + i] = v4f{f[0], f[1], f[2], f[3]};
    } else {
        xs[m * KC + i] = f[0];
    }
}

// Piece pc of vector i of row m (piece_width<VW>() floats).
template <int VW>
__device__ __forceinline__ void smem_load(const float* xs, int m, int i, int pc, int KC,
                                          float* f) {
    if constexpr (VW >= 4) {
        const v4f a = reinterpret_cast<const v4f*>(xs)[m * (KC / 4) + pc * (KC / 8) + i];
        f[0] = a.x; f[1] = a.y; f[2] = a.z; f[3] = a.w;
    } else {
        f[0] = xs[m * KC + i];
    }
}

struct GemvArgs {
    const scalar_t* x;       // [M, K]: residual (norm kernels) or activation (add kernel)
    const scalar_t* norm_w;  // [K] (norm kernels)
    float eps;
    const scalar_t* w;       // [rows, K]
    const scalar_t* bias;    // [N] or nullptr
    scalar_t* out;           // [M, N] out (norm), [M, I] act (silu), [M, N] residual (add)
    int n_out;               // N, or I for gate_up
    int K;
    int KC;                  // staged columns per chunk
};

// Row of weight r of unit u (clamped in range; the caller guards stores).
template <int MODE, int R>
__device__ __forceinline__ int unit_row(int u, int r, int n_out) {
    if constexpr (MODE == 1) {
        constexpr int P = R / 2;
        const int j = min(u * P + (r < P ? r : r - P), n_out - 1);
        return r < P ? j : n_out + j;
    } else {
        return min(u * R + r, n_out - 1);
    }
}

// Stage columns [k0, k0 + kc) of the M rows into shared memory (normalised for MODE 0/1).
template <int M, int MODE, int VW>
__device__ __forceinline__ void stage(const GemvArgs& a, float* xs, const float* scale, int k0,
                                      int kc) {
    const int nv = kc / VW;
    for (int i = threadIdx.x; i < nv; i += GEMV_THREADS) {
        float nw[VW];
        if constexpr (MODE != 2) load_vec<VW>(a.norm_w + k0 + i * VW, nw);
#pragma unroll
        for (int m = 0; m < M; ++m) {
            float f[VW];
            load_vec<VW>(a.x + (long long)m * a.K + k0 + i * VW, f);
            if constexpr (MODE != 2) {
#pragma unroll
                for (int e = 0; e < VW; ++e) f[e] = to_float(from_float(f[e] * scale[m] * nw[e]));
            }
            smem_store<VW>(xs, m, i, a.KC, f);
        }
    }
}

// acc[r][m] += W[row r, chunk vector i] . xs[m, vector i] for one vector position, a
// piece of 4 columns at a time (fewer live registers than the whole vector at once).
template <int M, int R, int VW>
__device__ __forceinline__ void fma_step(float (&acc)[R][M], const v4u (&raw)[R],
                                         const float* xs, int i, int KC) {
    constexpr int PW = piece_width<VW>();
#pragma unroll
    for (int pc = 0; pc < VW / PW; ++pc) {
        float wf[R][PW];
#pragma unroll
        for (int r = 0; r < R; ++r) unpack_w<VW>(raw[r], pc, wf[r]);
#pragma unroll
        for (int m = 0; m < M; ++m) {
            float xv[PW];
            smem_load<VW>(xs, m, i, pc, KC, xv);
#pragma unroll
            for (int r = 0; r < R; ++r) {
#pragma unroll
                for (int e = 0; e < PW; ++e) acc[r][m] = fmaf(wf[r][e], xv[e], acc[r][m]);
            }
        }
    }
}

// One warp: chunk vectors [i0, i1) of its R rows (the chunk starts at column k0).
template <int M, int R, int VW>
__device__ __forceinline__ void accumulate(float (&acc)[R][M], const scalar_t* const (&wrow)[R],
                                           const float* xs, int k0, int i0, int i1, int KC,
                                           int lane) {
    constexpr int U = GEMV_LOADS / R;
    int i = i0 + lane;
    for (; i + 32 * (U - 1) < i1; i += 32 * U) {
        v4u raw[U][R];
#pragma unroll
        for (int u = 0; u < U; ++u) {
#pragma unroll
            for (int r = 0; r < R; ++r) raw[u][r] = load_w<VW>(wrow[r] + k0 + (i + 32 * u) * VW);
        }
#pragma unroll
        for (int u = 0; u < U; ++u) fma_step<M, R, VW>(acc, raw[u], xs, i + 32 * u, KC);
    }
    for (; i < i1; i += 32) {
        v4u raw[R];
#pragma unroll
        for (int r = 0; r < R; ++r) raw[r] = load_w<VW>(wrow[r] + k0 + i * VW);
        fma_step<M, R, VW>(acc, raw, xs, i, KC);
    }
}

// Warp sums of the R * M values acc[r][m], value j = r * M + m landing in lane j: recursive
// halving, each step a lane keeps the half of its values its side of the butterfly owns and
// adds its partner's copy of them (31 shuffles in all; values beyond R * M are zero).
template <int R, int M>
__device__ __forceinline__ float warp_reduce_scatter(const float (&acc)[R][M], int lane) {
    float v[32];
#pragma unroll
    for (int j = 0; j < 32; ++j) {
        const int jj = j < R * M ? j : 0;  // in-bounds index even where the value is unused
        v[j] = j < R * M ? acc[jj / M][jj % M] : 0.f;
    }
#pragma unroll
    for (int step = 4; step >= 0; --step) {
        const int o = 1 << step;
        const bool upper = (lane & o) != 0;
#pragma unroll
        for (int j = 0; j < 16; ++j) {  // j < o (a constant once both loops are unrolled)
            if (j < o) {
                const float send = upper ? v[j] : v[j + o];
                const float keep = upper ? v[j + o] : v[j];
                v[j] = keep + __shfl_xor_sync(0xffffffffu, send, o);
            }
        }
    }
    return v[0];
}

// Vectors [i0, i1) of a chunk of nv that warp half `half` of `split` (1 or 2) handles; the
// first half takes a multiple of 32 (every lane the same number of vectors).
__device__ __forceinline__ void split_range(int split, int half, int nv, int& i0, int& i1) {
    const int h = split == 1 ? nv : (nv + 63) / 64 * 32;
    i0 = half * h;
    i1 = min(nv, i0 + h);
}

// L2 prefetch of the first two iterations of this warp's share of unit u's rows in the
// chunk of kc columns at k0 (issued before a prologue or a chunk's staging, so the weight
// stream does not stop while the activations are being prepared).
template <int MODE, int R, int VW>
__device__ __forceinline__ void prefetch_start(const GemvArgs& a, int u, int k0, int kc, int split,
                                               int half, int lane) {
    constexpr long long kStart = 2 * (GEMV_LOADS / R) * 32 * VW * (long long)sizeof(scalar_t);
    int i0, i1;
    split_range(split, half, kc / VW, i0, i1);
    const long long len = (long long)(i1 - i0) * VW * sizeof(scalar_t);
    const long long bytes = len < kStart ? len : kStart;
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const char* p = reinterpret_cast<const char*>(
            a.w + (long long)unit_row<MODE, R>(u, r, a.n_out) * a.K + k0 + (long long)i0 * VW);
        for (long long off = lane * 128; off < bytes; off += 32 * 128) prefetch_l2(p + off);
    }
}

__device__ __forceinline__ float silu(float g) { return g / (1.f + expf(-g)); }

template <int M, int MODE, int VW>
__device__ __forceinline__ void gemv_body(const GemvArgs& a) {
    constexpr int R = gemv_rows<M, MODE>();
    constexpr int P = MODE == 1 ? R / 2 : R;  // outputs per unit
    static_assert(R * M <= 32, "one lane per (row, m) output");
    extern __shared__ v4f gemv_smem[];
    float* xs = reinterpret_cast<float*>(gemv_smem);
    __shared__ float red[GEMV_WARPS][M];
    __shared__ float scale[M];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int K = a.K, KC = a.KC, n_out = a.n_out;
    const int units = (n_out + P - 1) / P;
    const int nchunks = (K + KC - 1) / KC;
    // Few units (at most half the warps): two warps per unit, each over half of every chunk,
    // their sums added through shared memory. slot = the unit's place in the CTA's round.
    const int split = units * 2 <= (int)gridDim.x * GEMV_WARPS ? 2 : 1;
    const int slots = GEMV_WARPS / split;
    const int slot = warp % slots, half = warp / slots;
    __shared__ float part[2][GEMV_WARPS / 2][2][32];  // [round & 1][slot][value][lane]

    pdl_trigger();  // the next kernel may launch (llmc.cuda.pdl_launch)
    {  // start the weight stream while the activations are being prepared
        const int u = slot * gridDim.x + blockIdx.x;
        if (u < units) prefetch_start<MODE, R, VW>(a, u, 0, min(KC, K), split, half, lane);
    }
    pdl_wait();  // x and the outputs: the previous kernel's (the weights were not)

    if constexpr (MODE != 2) {  // rms scale of each row, float32 sum of squares
        float ss[M];
#pragma unroll
        for (int m = 0; m < M; ++m) ss[m] = 0.f;
        for (int i = threadIdx.x; i < K / VW; i += GEMV_THREADS) {
#pragma unroll
            for (int m = 0; m < M; ++m) {
                float f[VW];
                load_vec<VW>(a.x + (long long)m * K + i * VW, f);
#pragma unroll
                for (int e = 0; e < VW; ++e) ss[m] += f[e] * f[e];
            }
        }
#pragma unroll
        for (int m = 0; m < M; ++m) {
            const float s = warp_sum(ss[m]);
            if (lane == 0) red[warp][m] = s;
        }
        __syncthreads();
        if (threadIdx.x < M) {
            float t = 0.f;
#pragma unroll
            for (int w = 0; w < GEMV_WARPS; ++w) t += red[w][threadIdx.x];
            scale[threadIdx.x] = rsqrtf(t / (float)K + a.eps);
        }
        __syncthreads();
    }

    if (nchunks == 1) {
        stage<M, MODE, VW>(a, xs, scale, 0, K);
        __syncthreads();
    }
    // round-robin over the CTAs first, so that a partial round spreads over every SM
    int rnd = 0;
    for (int base = 0; base < units; base += gridDim.x * slots, ++rnd) {
        const int u = base + slot * gridDim.x + blockIdx.x;
        const bool active = u < units;
        const int uc = active ? u : units - 1;
        const scalar_t* wrow[R];
#pragma unroll
        for (int r = 0; r < R; ++r) wrow[r] = a.w + (long long)unit_row<MODE, R>(uc, r, n_out) * K;
        float acc[R][M];
#pragma unroll
        for (int r = 0; r < R; ++r) {
#pragma unroll
            for (int m = 0; m < M; ++m) acc[r][m] = 0.f;
        }
        for (int c = 0; c < nchunks; ++c) {
            const int k0 = c * KC, kc = min(KC, K - k0);
            if (nchunks > 1) {
                if (active) prefetch_start<MODE, R, VW>(a, uc, k0, kc, split, half, lane);
                __syncthreads();  // every warp is done with the previous chunk
                stage<M, MODE, VW>(a, xs, scale, k0, kc);
                __syncthreads();
            }
            int i0, i1;  // this warp's vectors of the chunk
            split_range(split, half, kc / VW, i0, i1);
            if (active && i0 < i1) accumulate<M, R, VW>(acc, wrow, xs, k0, i0, i1, KC, lane);
        }
        if (!active) continue;
        // lane r * M + m (gate_up: p * M + m) owns output (r or p, m): v0 (and up in v1)
        float v0 = 0.f, v1 = 0.f;
        if constexpr (R * M >= 8) {  // one reduce-scatter: 31 shuffles instead of 5 * R * M
            v0 = warp_reduce_scatter<R, M>(acc, lane);
            if constexpr (MODE == 1) v1 = __shfl_down_sync(0xffffffffu, v0, P * M);
        } else {
#pragma unroll
            for (int r = 0; r < R; ++r) {
#pragma unroll
                for (int m = 0; m < M; ++m) acc[r][m] = warp_sum(acc[r][m]);
            }
#pragma unroll
            for (int r = 0; r < P; ++r) {
#pragma unroll
                for (int m = 0; m < M; ++m) {
                    if (lane == r * M + m) {
                        v0 = acc[r][m];
                        if constexpr (MODE == 1) v1 = acc[P + r][m];
                    }
                }
            }
        }
        if (split == 2) {  // add the other half of K (double-buffered by round parity)
            float* pv = part[rnd & 1][slot][0];
            if (half == 1) {
                pv[lane] = v0;
                pv[32 + lane] = v1;
            }
            pair_barrier(1 + slot);
            if (half == 1) continue;
            v0 += pv[lane];
            v1 += pv[32 + lane];
        }
        if (lane < P * M) {
            const int p = lane / M, m = lane - p * M, n = u * P + p;
            if (n < n_out) {
                scalar_t* o = a.out + (long long)m * n_out + n;
                if constexpr (MODE == 0) {
                    if (a.bias != nullptr) v0 += to_float(a.bias[n]);
                    *o = from_float(v0);
                } else if constexpr (MODE == 1) {
                    const float gs = to_float(from_float(silu(to_float(from_float(v0)))));
                    *o = from_float(gs * to_float(from_float(v1)));
                } else {
                    *o = from_float(to_float(*o) + to_float(from_float(v0)));
                }
            }
        }
    }
}

// Kernels of one M and one vector width; SUFFIX "" = 16-byte vectors, _scalar = VW 1.
#define GEMV_KERNELS(M, VW, SUFFIX)                                                           \
    extern "C" __global__ void __launch_bounds__(GEMV_THREADS, 1) gemv_norm_m##M##SUFFIX(     \
        const scalar_t* __restrict__ x, const scalar_t* __restrict__ norm_w, float eps,        \
        const scalar_t* __restrict__ w, const scalar_t* __restrict__ bias,                     \
        scalar_t* __restrict__ out, int N, int K, int KC) {                                    \
        gemv_body<M, 0, VW>(GemvArgs{x, norm_w, eps, w, bias, out, N, K, KC});                 \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(GEMV_THREADS, 1) gemv_norm_silu_m##M##SUFFIX( \
        const scalar_t* __restrict__ x, const scalar_t* __restrict__ norm_w, float eps,        \
        const scalar_t* __restrict__ w, scalar_t* __restrict__ out, int I, int K, int KC) {    \
        gemv_body<M, 1, VW>(GemvArgs{x, norm_w, eps, w, nullptr, out, I, K, KC});              \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(GEMV_THREADS, 1) gemv_add_m##M##SUFFIX(      \
        const scalar_t* __restrict__ x, const scalar_t* __restrict__ w,                        \
        scalar_t* __restrict__ residual, int N, int K, int KC) {                               \
        gemv_body<M, 2, VW>(GemvArgs{x, nullptr, 0.f, w, nullptr, residual, N, K, KC});        \
    }

#define GEMV_INSTANTIATE(M) GEMV_KERNELS(M, VEC, ) GEMV_KERNELS(M, 1, _scalar)

GEMV_INSTANTIATE(1)
GEMV_INSTANTIATE(2)
GEMV_INSTANTIATE(3)
GEMV_INSTANTIATE(4)
GEMV_INSTANTIATE(5)
GEMV_INSTANTIATE(6)
GEMV_INSTANTIATE(7)
GEMV_INSTANTIATE(8)
