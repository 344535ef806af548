// Host (CPU) emulation of the CUDA features cuda/gemv.cu uses, for tests/test_gemv_emulated.py:
// one std::thread per CUDA thread, std::barrier for __syncthreads and for warp shuffles; the
// CTAs of a grid run one after another. The test compiles (g++ -std=c++20) this file, then
// common.cuh and gemv.cu with their inline PTX replaced by plain C++, then this file again
// with GEMV_EMULATOR_MAIN defined, which adds the driver:
//   emulator MODE M N_OUT K KC GRID VEC HAS_BIAS EPS IN.bin OUT.bin
// IN.bin holds x [M, K], norm_w [K], W [rows, K], bias [N_OUT], out [M, N_OUT] (the
// residual of the add kernel) as raw scalar_t; OUT.bin receives out after the launch.
#ifndef GEMV_EMULATOR_MAIN
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

inline float __uint_as_float(unsigned int u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
inline unsigned int __float_as_uint(float f) {
    unsigned int u;
    std::memcpy(&u, &f, 4);
    return u;
}
inline float __int_as_float(int i) {
    float f;
    std::memcpy(&f, &i, 4);
    return f;
}
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline int min(int a, int b) { return a < b ? a : b; }

// 16-bit conversions (round to nearest even), standing in for the PTX cvt instructions.
inline float emu_half_to_float(unsigned short x) {
    _Float16 h;
    std::memcpy(&h, &x, 2);
    return (float)h;
}
inline unsigned short emu_float_to_half(float f) {
    _Float16 h = (_Float16)f;
    unsigned short x;
    std::memcpy(&x, &h, 2);
    return x;
}
inline unsigned short emu_float_to_bf16(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
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

#else  // GEMV_EMULATOR_MAIN: the driver
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
#endif  // GEMV_EMULATOR_MAIN
