// Host (CPU) emulation of the CUDA features cuda/gemv.cu and cuda/gemv_fp8.cu use, for
// tests/test_gemv_emulated.py: one std::thread per CUDA thread, std::barrier for
// __syncthreads and for warp shuffles and mma.sync; the CTAs of a grid run one after another.
// The test compiles (g++ -std=c++20) this file, then common.cuh and the kernel file with their
// inline PTX replaced by plain C++, then this file again with a driver macro defined:
// GEMV_EMULATOR_MAIN (gemv.cu) adds
//   emulator MODE M N_OUT K KC GRID VEC HAS_BIAS EPS IN.bin OUT.bin
// IN.bin holds x [M, K], norm_w [K], W [rows, K], bias [N_OUT], out [M, N_OUT] (the
// residual of the add kernel) as raw scalar_t; OUT.bin receives out after the launch.
// GEMV8_EMULATOR_MAIN (gemv_fp8.cu) adds
//   emulator MODE M N_OUT K S GRID VEC HAS_BIAS EPS IN.bin OUT.bin
// IN.bin holds w_scale [rows] float32, x [M, K], norm_w [K], bias [N_OUT], out [M, N_OUT]
// (scalar_t) and W [rows, K] (e4m3 bytes), each padded to a multiple of 16 bytes.
#if !defined(GEMV_EMULATOR_MAIN) && !defined(GEMV8_EMULATOR_MAIN)
#include <barrier>
#include <cmath>
#include <math.h>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#define __device__
#define __host__
#define __global__
#define __forceinline__ inline
#define __launch_bounds__(a, b)
#define __restrict__
#define __shared__ static

struct EmuDim {
    unsigned int x = 0, y = 0, z = 0;
};
thread_local EmuDim threadIdx, blockIdx;
EmuDim gridDim, blockDim;

static std::barrier<>* emu_cta_barrier = nullptr;
static std::vector<std::barrier<>*> emu_warp_barriers;
static float emu_shfl_buf[32][32];
static float* emu_smem = nullptr;

static std::barrier<>* emu_named_barriers[16];

inline void __syncthreads() { emu_cta_barrier->arrive_and_wait(); }

// bar.sync id, 64 (the only named barrier gemv.cu uses: two warps)
inline void emu_named_barrier(int id) { emu_named_barriers[id]->arrive_and_wait(); }

inline float __shfl_xor_sync(unsigned, float v, int o) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    emu_shfl_buf[warp][lane] = v;
    emu_warp_barriers[warp]->arrive_and_wait();
    const float r = emu_shfl_buf[warp][lane ^ o];
    emu_warp_barriers[warp]->arrive_and_wait();
    return r;
}

inline float __shfl_down_sync(unsigned, float v, int d) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    emu_shfl_buf[warp][lane] = v;
    emu_warp_barriers[warp]->arrive_and_wait();
    const float r = lane + d < 32 ? emu_shfl_buf[warp][lane + d] : v;
    emu_warp_barriers[warp]->arrive_and_wait();
    return r;
}

#include "emu_scalar.h"  // bit casts, rsqrtf, min, PRMT, 16-bit conversions

// e4m3 (1 sign, 4 exponent bits of bias 7, 3 mantissa bits; 0x7f / 0xff NaN), decoded exactly.
inline float emu_e4m3_to_float(unsigned char b) {
    const int e = (b >> 3) & 15, m = b & 7;
    const float v = (e == 15 && m == 7) ? NAN
                  : e == 0                ? std::ldexp((float)m, -9)
                                          : std::ldexp(1.f + m / 8.f, e - 7);
    return (b & 0x80) ? -v : v;
}

// cvt.rn.satfinite.e4m3x2.f32 on one value: saturate to +-448, round to nearest even.
inline unsigned char emu_float_to_e4m3(float f) {
    const unsigned char sign = (__float_as_uint(f) >> 24) & 0x80;
    const float a = std::fabs(f);
    if (std::isnan(f)) return sign | 0x7f;
    if (a >= 448.f) return sign | 0x7e;
    if (a == 0.f) return sign;
    int ex;
    std::frexp(a, &ex);
    ex -= 1;                // a in [2^ex, 2^(ex + 1))
    if (ex < -6) ex = -6;   // subnormals: quantum 2^-9
    const int q = (int)std::nearbyint(std::ldexp(a, 3 - ex));  // 8..16 normal, 0..8 subnormal
    int code = q < 8 ? q : (q == 16 ? (ex + 8) << 3 : ((ex + 7) << 3) | (q - 8));
    return sign | (unsigned char)(code > 0x7e ? 0x7e : code);
}

inline unsigned short emu_f32x2_to_e4m3x2(float lo, float hi) {
    return (unsigned short)(emu_float_to_e4m3(lo) | (emu_float_to_e4m3(hi) << 8));
}

// cvt.rn.f16x2.e4m3x2: low byte -> low half (exact).
inline unsigned int emu_e4m3x2_to_f16x2(unsigned short v) {
    return (unsigned int)emu_float_to_half(emu_e4m3_to_float(v & 0xff)) |
           ((unsigned int)emu_float_to_half(emu_e4m3_to_float(v >> 8)) << 16);
}

// mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 over the warp, from the PTX fragment
// layouts (g = lane / 4, t = lane % 4): a0 (g, 2t..2t+1), a1 (g+8, 2t..), a2 (g, 2t+8..),
// a3 (g+8, 2t+8..); b0 (k 2t..2t+1, n g), b1 (k 2t+8.., n g); d0 d1 (g, 2t / 2t+1),
// d2 d3 (g+8, 2t / 2t+1); products exact, sums in float32.
static unsigned int emu_mma_a[32][32][4], emu_mma_b[32][32][2];
inline void emu_mma_f16(float (&d)[4], const unsigned int (&a)[4], const unsigned int (&b)[2]) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int i = 0; i < 4; ++i) emu_mma_a[warp][lane][i] = a[i];
    for (int i = 0; i < 2; ++i) emu_mma_b[warp][lane][i] = b[i];
    emu_warp_barriers[warp]->arrive_and_wait();
    auto half = [](unsigned int w, int hi) {
        return emu_half_to_float((unsigned short)(hi ? w >> 16 : w & 0xffff));
    };
    auto A = [&](int row, int k) {
        return half(emu_mma_a[warp][(row % 8) * 4 + (k % 8) / 2][(row >= 8) + 2 * (k >= 8)], k & 1);
    };
    auto B = [&](int k, int col) {
        return half(emu_mma_b[warp][col * 4 + (k % 8) / 2][k >= 8], k & 1);
    };
    const int g = lane >> 2, t = lane & 3;
    for (int i = 0; i < 4; ++i) {
        const int row = g + 8 * (i >= 2), col = 2 * t + (i & 1);
        float s = d[i];
        for (int k = 0; k < 16; ++k) s += A(row, k) * B(k, col);
        d[i] = s;
    }
    emu_warp_barriers[warp]->arrive_and_wait();
}

// Launch: every CTA of the grid in turn, blockDim threads each.
template <typename F>
void emu_launch(int grid, int block, size_t smem_bytes, F kernel) {
    std::vector<float> smem(smem_bytes / 4 + 4);
    emu_smem = smem.data();
    gridDim.x = grid;
    blockDim.x = block;
    for (int b = 0; b < grid; ++b) {
        std::barrier<> cta(block);
        emu_cta_barrier = &cta;
        std::vector<std::barrier<>*> warps;
        for (int w = 0; w < block / 32; ++w) warps.push_back(new std::barrier<>(32));
        for (int i = 0; i < 16; ++i) emu_named_barriers[i] = new std::barrier<>(64);
        emu_warp_barriers = warps;
        std::vector<std::thread> threads;
        for (int t = 0; t < block; ++t) {
            threads.emplace_back([=]() {
                threadIdx.x = t;
                blockIdx.x = b;
                kernel();
            });
        }
        for (auto& th : threads) th.join();
        for (auto* w : warps) delete w;
        for (int i = 0; i < 16; ++i) delete emu_named_barriers[i];
    }
}

#elif defined(GEMV_EMULATOR_MAIN)  // the gemv.cu driver
#include <fstream>
#include <iterator>

template <typename F>
static void emu_run(int grid, size_t smem, F kernel) {
    emu_launch(grid, 512, smem, kernel);
}

int main(int argc, char** argv) {
    if (argc != 12) return 2;
    const int mode = atoi(argv[1]), M = atoi(argv[2]), n = atoi(argv[3]), K = atoi(argv[4]);
    const int KC = atoi(argv[5]), grid = atoi(argv[6]), vec = atoi(argv[7]);
    const int has_bias = atoi(argv[8]);
    const float eps = (float)atof(argv[9]);
    std::ifstream in(argv[10], std::ios::binary);
    std::vector<char> blob((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    const size_t rows = mode == 1 ? 2 * (size_t)n : (size_t)n;
    scalar_t* x = reinterpret_cast<scalar_t*>(blob.data());
    scalar_t* nw = x + (size_t)M * K;
    scalar_t* w = nw + K;
    scalar_t* bias = w + rows * K;
    scalar_t* out = bias + n;
    scalar_t* b = has_bias ? bias : nullptr;
    const size_t smem = (size_t)M * KC * 4;
#define GEMV_EMU_CASE(MM)                                                                   \
    case MM:                                                                                \
        if (mode == 0 && vec)                                                               \
            emu_run(grid, smem, [&] { gemv_norm_m##MM(x, nw, eps, w, b, out, n, K, KC); }); \
        if (mode == 0 && !vec)                                                              \
            emu_run(grid, smem,                                                             \
                    [&] { gemv_norm_m##MM##_scalar(x, nw, eps, w, b, out, n, K, KC); });    \
        if (mode == 1 && vec)                                                               \
            emu_run(grid, smem, [&] { gemv_norm_silu_m##MM(x, nw, eps, w, out, n, K, KC); }); \
        if (mode == 1 && !vec)                                                              \
            emu_run(grid, smem,                                                             \
                    [&] { gemv_norm_silu_m##MM##_scalar(x, nw, eps, w, out, n, K, KC); });  \
        if (mode == 2 && vec) emu_run(grid, smem, [&] { gemv_add_m##MM(x, w, out, n, K, KC); }); \
        if (mode == 2 && !vec)                                                              \
            emu_run(grid, smem, [&] { gemv_add_m##MM##_scalar(x, w, out, n, K, KC); });     \
        break;
    switch (M) {
        GEMV_EMU_CASE(1) GEMV_EMU_CASE(2) GEMV_EMU_CASE(3) GEMV_EMU_CASE(4)
        GEMV_EMU_CASE(5) GEMV_EMU_CASE(6) GEMV_EMU_CASE(7) GEMV_EMU_CASE(8)
        default: return 2;
    }
    std::ofstream(argv[11], std::ios::binary)
        .write(reinterpret_cast<const char*>(out), (std::streamsize)((size_t)M * n * sizeof(scalar_t)));
    return 0;
}
#else  // GEMV8_EMULATOR_MAIN: the gemv_fp8.cu driver
#include <fstream>
#include <iterator>

int main(int argc, char** argv) {
    if (argc != 12) return 2;
    const int mode = atoi(argv[1]), M = atoi(argv[2]), n = atoi(argv[3]), K = atoi(argv[4]);
    const int S = atoi(argv[5]), grid = atoi(argv[6]), vec = atoi(argv[7]);
    const int has_bias = atoi(argv[8]);
    const float eps = (float)atof(argv[9]);
    std::ifstream in(argv[10], std::ios::binary);
    std::vector<char> blob((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    const size_t rows = mode == 1 ? 2 * (size_t)n : (size_t)n;
    size_t off = 0;
    auto take = [&](size_t bytes) {
        char* p = blob.data() + off;
        off += (bytes + 15) / 16 * 16;
        return p;
    };
    const float* ws = reinterpret_cast<const float*>(take(rows * 4));
    const scalar_t* x = reinterpret_cast<const scalar_t*>(take((size_t)M * K * sizeof(scalar_t)));
    const scalar_t* nw = reinterpret_cast<const scalar_t*>(take((size_t)K * sizeof(scalar_t)));
    const scalar_t* bias = reinterpret_cast<const scalar_t*>(take((size_t)n * sizeof(scalar_t)));
    scalar_t* out = reinterpret_cast<scalar_t*>(take((size_t)M * n * sizeof(scalar_t)));
    const unsigned char* w = reinterpret_cast<const unsigned char*>(take(rows * K));
    if (off > blob.size()) return 3;
    const scalar_t* b = has_bias ? bias : nullptr;
    const size_t smem = (size_t)M * S;
#define G8_NORM_ARGS x, nw, eps, w, ws, b, out, n, K, S
#define G8_SILU_ARGS x, nw, eps, w, ws, out, n, K, S
#define G8_ADD_ARGS x, w, ws, out, n, K, S
#define GEMV8_EMU_CASE(MM)                                                                  \
    case MM:                                                                                \
        emu_launch(grid, 512, smem, [&] {                                                   \
            if (mode == 0)                                                                  \
                vec ? gemv8_norm_m##MM(G8_NORM_ARGS)                                        \
                    : gemv8_norm_m##MM##_scalar(G8_NORM_ARGS);                              \
            if (mode == 1)                                                                  \
                vec ? gemv8_norm_silu_m##MM(G8_SILU_ARGS)                                   \
                    : gemv8_norm_silu_m##MM##_scalar(G8_SILU_ARGS);                         \
            if (mode == 2)                                                                  \
                vec ? gemv8_add_m##MM(G8_ADD_ARGS) : gemv8_add_m##MM##_scalar(G8_ADD_ARGS); \
        });                                                                                 \
        break;
    switch (M) {
        GEMV8_EMU_CASE(1) GEMV8_EMU_CASE(2) GEMV8_EMU_CASE(3) GEMV8_EMU_CASE(4)
        GEMV8_EMU_CASE(5) GEMV8_EMU_CASE(6) GEMV8_EMU_CASE(7) GEMV8_EMU_CASE(8)
        default: return 2;
    }
    const std::streamsize out_bytes = (std::streamsize)((size_t)M * n * sizeof(scalar_t));
    std::ofstream(argv[11], std::ios::binary).write(reinterpret_cast<const char*>(out), out_bytes);
    return 0;
}
#endif  // drivers
