// prefill_sm90_producer.cuh: the producer warpgroup's tile loaders of
// prefill_attention_sm90.cu (inlined there by llmc.cuda.kernels.source after its tile macros
// HD, BN, CH, NKV and swz, which it uses). A K or V tile of BN keys of kv head kvh goes into a
// swizzled stage; keys >= kv_end are zeros. Two variants (SM90_PRODUCER_V2 in the kernel):
//   v2 (default): a tile's block-table entries are loaded once per warp (lane l: relative
//     block l) and shuffled to the keys, so the 16-byte cp.async copies issue back to back;
//     fp8 tiles are copied raw into a per-thread ring and converted from shared memory.
//   v1 (88a49e6): one dependent table load per copy; fp8 converted from global loads.
#pragma once

// ---- producer: one K or V tile --------------------------------------------------------
// Keys [kt, kt + BN) of kv head kvh into a swizzled stage; keys >= kv_end are zeros.
// Thread p copies chunk column p % CH of keys p / CH + i * (128 / CH).
__device__ __forceinline__ void load_tile(unsigned dst, const scalar_t* cache, const int* bt,
                                          int bs_shift, int kt, int kv_end, int kvh, int p) {
    constexpr int kpp = 128 / CH;  // keys per pass
    const int c = p % CH;
#pragma unroll 4
    for (int i = 0; i < BN / kpp; ++i) {
        const int key = p / CH + i * kpp, j = kt + key;
        const scalar_t* src = cache;
        int bytes = 0;
        if (j < kv_end) {
            const long long slot = ((long long)bt[j >> bs_shift] << bs_shift) + (j & ((1 << bs_shift) - 1));
            src = cache + (slot * NKV + kvh) * HD + c * 8;
            bytes = 16;
        }
        cp_async16(dst + swz(key, c, BN), src, bytes);
    }
}

// Two e4m3 (low byte first) -> one 32-bit register of two 16-bit activation values (exact).
__device__ __forceinline__ unsigned e4m3x2_to_16(unsigned short v) {
    unsigned h;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h) : "h"(v));
#if LLMC_DTYPE == 2
    float lo, hi;
    asm("cvt.f32.f16 %0, %1;" : "=f"(lo) : "h"((unsigned short)(h & 0xffffu)));
    asm("cvt.f32.f16 %0, %1;" : "=f"(hi) : "h"((unsigned short)(h >> 16)));
    return pack2(lo, hi);
#else
    return h;
#endif
}

// 16 e4m3 values (group g of key `key`: head dims 16g .. 16g+15) -> their two 16-bit chunks
// 2g, 2g + 1 in a swizzled stage.
__device__ __forceinline__ void store16_fp8(unsigned dst, int key, int g, const v4u& raw) {
    const unsigned w[4] = {raw.x, raw.y, raw.z, raw.w};
    unsigned h[8];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        h[2 * k] = e4m3x2_to_16((unsigned short)(w[k] & 0xffffu));
        h[2 * k + 1] = e4m3x2_to_16((unsigned short)(w[k] >> 16));
    }
    asm volatile("st.shared.v4.u32 [%0], {%1,%2,%3,%4};" ::"r"(dst + swz(key, 2 * g, BN)),
                 "r"(h[0]), "r"(h[1]), "r"(h[2]), "r"(h[3])
                 : "memory");
    asm volatile("st.shared.v4.u32 [%0], {%1,%2,%3,%4};" ::"r"(dst + swz(key, 2 * g + 1, BN)),
                 "r"(h[4]), "r"(h[5]), "r"(h[6]), "r"(h[7])
                 : "memory");
}

// fp8 cache: thread p converts 16-byte group g = p % (HD / 16) (16 values = 2 smem chunks)
// of keys p / (HD / 16) + i * kpp.
__device__ __forceinline__ void load_tile_fp8(unsigned dst, const unsigned char* cache,
                                              const int* bt, int bs_shift, int kt, int kv_end,
                                              int kvh, int p) {
    constexpr int gpr = HD / 16, kpp = 128 / gpr;
    const int g = p % gpr;
#pragma unroll 4
    for (int i = 0; i < BN / kpp; ++i) {
        const int key = p / gpr + i * kpp, j = kt + key;
        v4u raw = {0u, 0u, 0u, 0u};
        if (j < kv_end) {
            const long long slot = ((long long)bt[j >> bs_shift] << bs_shift) + (j & ((1 << bs_shift) - 1));
            const unsigned char* src = cache + (slot * NKV + kvh) * HD + g * 16;
            asm volatile("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];"
                         : "=r"(raw.x), "=r"(raw.y), "=r"(raw.z), "=r"(raw.w)
                         : "l"(src));
        }
        store16_fp8(dst, key, g, raw);
    }
}

// One K or V tile into a stage, then this thread's arrival on the stage's full barrier:
// cp.async copies arrive when they land; converted fp8 stores are fenced for wgmma first.
template <bool FP8>
__device__ __forceinline__ void produce(unsigned dst, const void* cache, unsigned full,
                                        const int* bt, int bs_shift, int kt, int kv_end, int kvh,
                                        int p) {
    if constexpr (FP8) {
        load_tile_fp8(dst, (const unsigned char*)cache, bt, bs_shift, kt, kv_end, kvh, p);
        fence_async_smem();
        mbar_arrive(full);
    } else {
        load_tile(dst, (const scalar_t*)cache, bt, bs_shift, kt, kv_end, kvh, p);
        mbar_arrive_copies(full);
    }
}

#if SM90_PRODUCER_V2
// Lane `lane`'s block-table entry for the tile at kt: relative block lane (0 past the keys
// the CTA reads). With tokens_per_block >= 4 a 128-key tile spans at most 32 blocks, and
// key `key` of the tile lies in relative block key >> bs_shift (kt is a multiple of the block
// size, or the tile lies inside one block).
__device__ __forceinline__ int tile_blocks(const int* bt, int bs_shift, int kt, int kv_end,
                                           int lane) {
    const int b = (kt >> bs_shift) + lane;
    return (b << bs_shift) < kv_end ? bt[b] : 0;
}

// Cache slot (token row of the pool) of key j (relative key `key`) of the tile; slot 0 past
// kv_end (a valid address for the zero-filling copy). From the warp's shuffled entries
// (TINY false), or from the table for blocks of 1-2 tokens (more than 32 per tile: TINY).
template <bool TINY>
__device__ __forceinline__ unsigned key_slot(int ent, const int* bt, int bs_shift, int key,
                                             int j, bool in) {
    int b;
    if constexpr (TINY)
        b = in ? bt[j >> bs_shift] : 0;
    else
        b = __shfl_sync(0xffffffffu, ent, key >> bs_shift);
    return in ? ((unsigned)b << bs_shift) | (unsigned)(j & ((1 << bs_shift) - 1)) : 0u;
}

// load_tile with the shuffled entries: no load between two copies, so they issue back to back.
// Keys p / CH + i * kpp share one swizzle phase (kpp is a multiple of 8).
template <bool TINY>
__device__ __forceinline__ void load_tile_v2(unsigned dst, const scalar_t* cache, int ent,
                                             const int* bt, int bs_shift, int kt, int kv_end,
                                             int kvh, int p) {
    constexpr int kpp = 128 / CH;
    const int c = p % CH;
    const scalar_t* base = cache + kvh * HD + c * 8;
    dst += swz(p / CH, c, BN);
#pragma unroll 4
    for (int i = 0; i < BN / kpp; ++i) {
        const int key = p / CH + i * kpp, j = kt + key;
        const bool in = j < kv_end;
        const unsigned slot = key_slot<TINY>(ent, bt, bs_shift, key, j, in);
        cp_async16(dst + i * kpp * 128, base + (unsigned long long)slot * (NKV * HD),
                   in ? 16 : 0);
    }
}

// fp8, step 1: thread p's 16-byte groups of the tile (as load_tile_fp8 assigns them) copied raw
// to raw + (i * 128 + p) * 16, zeros past kv_end. Only thread p reads them back (step 2), so
// its own cp.async.wait_group orders copy and conversion: no barrier.
template <bool TINY>
__device__ __forceinline__ void copy_raw_fp8(unsigned raw, const unsigned char* cache, int ent,
                                             const int* bt, int bs_shift, int kt, int kv_end,
                                             int kvh, int p) {
    constexpr int gpr = HD / 16, kpp = 128 / gpr;
    const unsigned char* base = cache + kvh * HD + (p % gpr) * 16;
    raw += (unsigned)p * 16u;
#pragma unroll 4
    for (int i = 0; i < BN / kpp; ++i) {
        const int key = p / gpr + i * kpp, j = kt + key;
        const bool in = j < kv_end;
        const unsigned slot = key_slot<TINY>(ent, bt, bs_shift, key, j, in);
        cp_async16(raw + i * 128 * 16, base + (unsigned long long)slot * (NKV * HD), in ? 16 : 0);
    }
}

// One K or V tile (16-bit cache) / one raw fp8 tile, the table read chosen once per tile.
__device__ __forceinline__ void load_tile_v2(unsigned dst, const scalar_t* cache, int ent,
                                             const int* bt, int bs_shift, int kt, int kv_end,
                                             int kvh, int p) {
    if (bs_shift < 2)
        load_tile_v2<true>(dst, cache, ent, bt, bs_shift, kt, kv_end, kvh, p);
    else
        load_tile_v2<false>(dst, cache, ent, bt, bs_shift, kt, kv_end, kvh, p);
}
__device__ __forceinline__ void copy_raw_fp8(unsigned raw, const unsigned char* cache, int ent,
                                             const int* bt, int bs_shift, int kt, int kv_end,
                                             int kvh, int p) {
    if (bs_shift < 2)
        copy_raw_fp8<true>(raw, cache, ent, bt, bs_shift, kt, kv_end, kvh, p);
    else
        copy_raw_fp8<false>(raw, cache, ent, bt, bs_shift, kt, kv_end, kvh, p);
}

// fp8, step 2: the raw groups -> 16-bit values in the swizzled stage (exact), fenced for wgmma,
// then this thread's arrival on the stage's full barrier.
__device__ __forceinline__ void convert_raw_fp8(unsigned dst, unsigned raw, unsigned full, int p) {
    constexpr int gpr = HD / 16, kpp = 128 / gpr;
    const int g = p % gpr;
#pragma unroll 4
    for (int i = 0; i < BN / kpp; ++i) {
        const int key = p / gpr + i * kpp;
        v4u w;
        asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];"
                     : "=r"(w.x), "=r"(w.y), "=r"(w.z), "=r"(w.w)
                     : "r"(raw + (unsigned)(i * 128 + p) * 16u)
                     : "memory");
        store16_fp8(dst, key, g, w);
    }
    fence_async_smem();
    mbar_arrive(full);
}

#endif
