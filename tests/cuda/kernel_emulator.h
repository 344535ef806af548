// Host (CPU) emulation of the CUDA features llmc's kernels use, for tests that run a kernel
// source compiled as host C++ (tests/helpers/cuda_emulator.py builds the program: this
// header, then the kernel source with common.cuh's PTX dtype section replaced by this
// header's EMU_DTYPE_SECTION part, then a generated main()).
//
// One std::thread per CUDA thread of a CTA, the CTAs of a (3-D) grid one after another;
// std::barrier stands for __syncthreads and for the warp-synchronous operations (shuffles,
// mma.sync, ldmatrix), which exchange values through a per-warp buffer. ``__shared__``
// variables become function statics (shared by the CTA's threads; CTAs do not overlap).
// cp.async copies at once (the wait is a no-op); atomics take a mutex.
//
// Warp-level matrix instructions follow the PTX ISA fragment layouts (g = lane / 4,
// t = lane % 4): mma.m16n8k16 A (row) a0 = (g, 2t..2t+1), a1 = (g+8, 2t..), a2 = (g, 2t+8..),
// a3 = (g+8, 2t+8..); B (col) b0 = (k 2t..2t+1, n g), b1 = (k 2t+8.., n g); C c0, c1 =
// (g, 2t), (g, 2t+1), c2, c3 = (g+8, 2t), (g+8, 2t+1); ldmatrix .x4: lanes 8i..8i+7 address
// the rows of matrix i, lane l receives (row l/4, cols 2(l%4), +1) of each (.trans: the
// transposed element pairs). tests/cuda/test_kernels_emulated.py checks the emulation on
// prefill_attention.cu, whose mma code the GPU tests verify.
#ifndef EMU_DTYPE_SECTION
#ifndef LLMC_KERNEL_EMULATOR_H
#define LLMC_KERNEL_EMULATOR_H
#define LLMC_HOST_EMULATION 1

#include <barrier>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <math.h>
#include <mutex>
#include <thread>
#include <vector>

#define __device__
#define __host__
#define __global__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __cluster_dims__(...)
#define __restrict__
#define __shared__ static

struct EmuDim {
    unsigned int x = 1, y = 1, z = 1;
};
thread_local EmuDim threadIdx, blockIdx;
EmuDim gridDim, blockDim;

static std::barrier<>* emu_cta_barrier = nullptr;
static std::vector<std::barrier<>*> emu_warp_barriers;
// per warp: 32 lanes x 16 words (shuffles use word 0; mma / ldmatrix up to 6 words)
static unsigned long long emu_xchg[32][32][16];
static std::mutex emu_atomic_mutex;

inline void __syncthreads() { emu_cta_barrier->arrive_and_wait(); }
inline void __syncwarp(unsigned = 0xffffffffu) {
    emu_warp_barriers[threadIdx.x >> 5]->arrive_and_wait();
}
inline void __threadfence() {}
inline float load_cg(const float* p) { return *(const volatile float*)p; }  // decode_attention.cu
inline int atomicAdd(int* p, int v) {
    std::lock_guard<std::mutex> lock(emu_atomic_mutex);
    const int old = *p;
    *p = old + v;
    return old;
}
inline float atomicAdd(float* p, float v) {
    std::lock_guard<std::mutex> lock(emu_atomic_mutex);
    const float old = *p;
    *p = old + v;
    return old;
}
// `extern __shared__` (dynamic shared memory) of the kernels that name it under
// LLMC_HOST_EMULATION (gemv_wo.cu): one CTA at a time, so one buffer.
alignas(16) static unsigned char emu_dyn_smem[256 * 1024];

inline unsigned atomicAdd(unsigned* p, unsigned v) {  // sampling.cu
    std::lock_guard<std::mutex> lock(emu_atomic_mutex);
    const unsigned old = *p;
    *p = old + v;
    return old;
}
inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) {
    std::lock_guard<std::mutex> lock(emu_atomic_mutex);
    const unsigned long long old = *p;
    *p = old + v;
    return old;
}
inline unsigned atomicMax(unsigned* p, unsigned v) {  // gemv_wo.cu
    std::lock_guard<std::mutex> lock(emu_atomic_mutex);
    const unsigned old = *p;
    *p = old > v ? old : v;
    return old;
}
inline unsigned __umulhi(unsigned a, unsigned b) {
    return (unsigned)(((unsigned long long)a * b) >> 32);
}

inline unsigned emu_lane() { return threadIdx.x & 31; }
inline unsigned long long* emu_slot(unsigned lane) {
    return emu_xchg[threadIdx.x >> 5][lane];
}

template <typename T>
inline T emu_shfl(T v, int src_lane) {
    unsigned long long bits = 0;
    std::memcpy(&bits, &v, sizeof(T));
    emu_slot(emu_lane())[0] = bits;
    __syncwarp();
    bits = emu_slot((unsigned)src_lane & 31)[0];
    __syncwarp();
    T r;
    std::memcpy(&r, &bits, sizeof(T));
    return r;
}
template <typename T>
inline T __shfl_xor_sync(unsigned, T v, int o) {
    return emu_shfl(v, (int)(emu_lane() ^ (unsigned)o));
}
template <typename T>
inline T __shfl_sync(unsigned, T v, int src) {
    return emu_shfl(v, src);
}
template <typename T>
inline T __shfl_down_sync(unsigned, T v, int d) {
    const int src = (int)emu_lane() + d;
    const T r = emu_shfl(v, src < 32 ? src : (int)emu_lane());
    return r;
}

// sampling.cu's warp-aggregated histograms (words 1 and 2 of the lane slots) and warp vote
inline unsigned __match_any_sync(unsigned, unsigned v) {
    emu_slot(emu_lane())[1] = v;
    __syncwarp();
    unsigned m = 0;
    for (unsigned l = 0; l < 32; ++l) m |= (unsigned)(emu_slot(l)[1] == v) << l;
    __syncwarp();
    return m;
}
inline unsigned __reduce_add_sync(unsigned mask, unsigned v) {
    emu_slot(emu_lane())[2] = v;
    __syncwarp();
    unsigned s = 0;
    for (unsigned l = 0; l < 32; ++l)
        if (mask >> l & 1u) s += (unsigned)emu_slot(l)[2];
    __syncwarp();
    return s;
}
inline int __any_sync(unsigned, int pred) {  // word 3
    emu_slot(emu_lane())[3] = pred != 0;
    __syncwarp();
    int any = 0;
    for (unsigned l = 0; l < 32; ++l) any |= (int)emu_slot(l)[3];
    __syncwarp();
    return any;
}
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __ffs(int x) { return __builtin_ffs(x); }

#include "emu_scalar.h"  // bit casts, rsqrtf, min, PRMT, 16-bit conversions (shared)
inline int max(int a, int b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline int __float2int_rn(float x) { return (int)std::nearbyint(x); }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __frcp_rn(float a) { return 1.0f / a; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }

inline float emu_bf16_to_float(unsigned short x) { return __uint_as_float(((unsigned)x) << 16); }

// fp8.cuh's PTX helpers
inline float half_bits_to_float(unsigned h) { return emu_half_to_float((unsigned short)h); }
inline unsigned fp16x2_times_256(unsigned h) {
    const unsigned lo = emu_float_to_half(emu_half_to_float((unsigned short)(h & 0xffffu)) * 256.f);
    const unsigned hi = emu_float_to_half(emu_half_to_float((unsigned short)(h >> 16)) * 256.f);
    return lo | (hi << 16);
}

// ---- warp-level matrix operations -------------------------------------------------------
// 16-bit operand element -> float: bf16 (EMU_MMA_BF16 = 1) or fp16.
inline float emu_mma_elem(unsigned w, int hi, int bf16) {
    const unsigned short h = (unsigned short)(hi ? (w >> 16) : (w & 0xffffu));
    return bf16 ? emu_bf16_to_float(h) : emu_half_to_float(h);
}

// mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}: D = A B + C, float32 accumulation
// (products and sums in double, rounded once: tensor cores do not round each product).
inline void emu_mma16816(float* c, const unsigned* a, unsigned b0, unsigned b1, int bf16) {
    unsigned long long* s = emu_slot(emu_lane());
    s[0] = a[0]; s[1] = a[1]; s[2] = a[2]; s[3] = a[3]; s[4] = b0; s[5] = b1;
    __syncwarp();
    float A[16][16], B[16][8];
    for (unsigned l = 0; l < 32; ++l) {
        const unsigned g = l >> 2, t = l & 3;
        const unsigned long long* f = emu_slot(l);
        for (int h = 0; h < 2; ++h) {
            A[g][2 * t + h] = emu_mma_elem((unsigned)f[0], h, bf16);
            A[g + 8][2 * t + h] = emu_mma_elem((unsigned)f[1], h, bf16);
            A[g][2 * t + 8 + h] = emu_mma_elem((unsigned)f[2], h, bf16);
            A[g + 8][2 * t + 8 + h] = emu_mma_elem((unsigned)f[3], h, bf16);
            B[2 * t + h][g] = emu_mma_elem((unsigned)f[4], h, bf16);
            B[2 * t + 8 + h][g] = emu_mma_elem((unsigned)f[5], h, bf16);
        }
    }
    __syncwarp();
    const unsigned g = emu_lane() >> 2, t = emu_lane() & 3;
    for (int i = 0; i < 4; ++i) {
        const unsigned row = g + (i >= 2 ? 8 : 0), col = 2 * t + (i & 1);
        double acc = c[i];
        for (int k = 0; k < 16; ++k) acc += (double)A[row][k] * (double)B[k][col];
        c[i] = (float)acc;
    }
}

// ldmatrix.sync.aligned.m8n8.x4{.trans}.shared.b16 from host pointers (row addresses).
inline void emu_ldmatrix_x4(const void* row_addr, unsigned* r, bool trans) {
    unsigned long long* s = emu_slot(emu_lane());
    s[0] = (unsigned long long)(uintptr_t)row_addr;
    __syncwarp();
    const unsigned l = emu_lane(), g = l >> 2, t = l & 3;
    for (int m = 0; m < 4; ++m) {
        unsigned short e[2];
        for (int h = 0; h < 2; ++h) {
            unsigned row, col;
            if (!trans) { row = g; col = 2 * t + h; }
            else { row = 2 * t + h; col = g; }
            const unsigned short* p =
                (const unsigned short*)(uintptr_t)emu_slot(8 * m + row)[0];
            e[h] = p[col];
        }
        r[m] = (unsigned)e[0] | ((unsigned)e[1] << 16);
    }
    __syncwarp();
}

// ---- launch -----------------------------------------------------------------------------
template <typename F>
void emu_launch(EmuDim grid, int block, F kernel) {
    gridDim = grid;
    blockDim = EmuDim{(unsigned)block, 1, 1};
    for (unsigned bz = 0; bz < grid.z; ++bz)
        for (unsigned by = 0; by < grid.y; ++by)
            for (unsigned bx = 0; bx < grid.x; ++bx) {
                std::barrier<> cta(block);
                emu_cta_barrier = &cta;
                std::vector<std::barrier<>*> warps;
                for (int w = 0; w < (block + 31) / 32; ++w) warps.push_back(new std::barrier<>(32));
                emu_warp_barriers = warps;
                std::vector<std::thread> threads;
                for (int t = 0; t < block; ++t) {
                    threads.emplace_back([=]() {
                        threadIdx = EmuDim{(unsigned)t, 0, 0};
                        blockIdx = EmuDim{bx, by, bz};
                        kernel();
                    });
                }
                for (auto& th : threads) th.join();
                for (auto* w : warps) delete w;
            }
}

// The driver's I/O: the whole argument blob is read from and written back to one file.
inline std::vector<char> emu_read(const char* path) {
    std::ifstream in(path, std::ios::binary);
    return std::vector<char>((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}
inline void emu_write(const char* path, const std::vector<char>& blob) {
    std::ofstream(path, std::ios::binary).write(blob.data(), (std::streamsize)blob.size());
}
#endif  // LLMC_KERNEL_EMULATOR_H

#else  // EMU_DTYPE_SECTION: stands in for common.cuh's PTX dtype conversions
#if LLMC_DTYPE == 0
typedef float scalar_t;
inline float to_float(float x) { return x; }
inline float from_float(float x) { return x; }
#else
typedef unsigned short scalar_t;
inline float to_float(unsigned short x) {
#if LLMC_DTYPE == 1
    return emu_half_to_float(x);
#else
    return emu_bf16_to_float(x);
#endif
}
inline unsigned short from_float(float f) {
#if LLMC_DTYPE == 1
    return emu_float_to_half(f);
#else
    return emu_float_to_bf16(f);
#endif
}
inline unsigned int pack2(float lo, float hi) {
    return (unsigned int)from_float(lo) | ((unsigned int)from_float(hi) << 16);
}
#endif

// prefill_attention.cu's PTX helpers: shared-memory "addresses" are the host addresses of
// the statics (the program is linked -no-pie, so they fit 32 bits).
inline unsigned smem_addr(const void* p) {
    const uintptr_t a = (uintptr_t)p;
    if (a >> 32) { std::fprintf(stderr, "shared address above 4 GB\n"); std::abort(); }
    return (unsigned)a;
}
inline void mma16816(float* c, const unsigned* a, unsigned b0, unsigned b1) {
    emu_mma16816(c, a, b0, b1, LLMC_DTYPE == 2);
}
inline void ldsm_x4(unsigned addr, unsigned* r) { emu_ldmatrix_x4((const void*)(uintptr_t)addr, r, false); }
inline void ldsm_x4_trans(unsigned addr, unsigned* r) {
    emu_ldmatrix_x4((const void*)(uintptr_t)addr, r, true);
}
inline void cp_async16(unsigned saddr, const void* g, int bytes) {
    char* d = (char*)(uintptr_t)saddr;
    std::memcpy(d, g, bytes);
    std::memset(d + bytes, 0, 16 - bytes);
}
inline void cp_async_commit() {}
inline void cp_async_wait_all() {}

// decode_mma.cuh's PTX helpers
template <bool F16>
inline void mma_16816(float (&c)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                      unsigned b0, unsigned b1) {
    const unsigned a[4] = {a0, a1, a2, a3};
    emu_mma16816(c, a, b0, b1, F16 ? 0 : 1);
}
template <bool F16>
inline unsigned pack_op(float lo, float hi) {
    if (F16) return (unsigned)emu_float_to_half(lo) | ((unsigned)emu_float_to_half(hi) << 16);
    return (unsigned)emu_float_to_bf16(lo) | ((unsigned)emu_float_to_bf16(hi) << 16);
}
#undef EMU_DTYPE_SECTION
#endif  // EMU_DTYPE_SECTION
