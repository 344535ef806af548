// sampling_select.cuh: the radix selects of sampling.cu's top-k / top-p thresholds, and the
// exchange between the C CTAs of a row they run on (C == 1: one CTA, plain loads and
// __syncthreads; C > 1: a thread-block cluster, distributed shared memory, sm_90).
//
// Keys are the order-preserving 32-bit images of the values (-0 == +0). A select runs 4
// rounds of 8-bit digits, high to low: each CTA histograms the digit over its slice's
// candidate keys (those matching the digits chosen so far) in shared memory, every CTA sums
// the C histograms (integers: exact in any order, so every CTA of the row reaches the same
// digit) and one thread per CTA finds the bin holding the threshold. Requires
// blockDim.x == SAMPLE_THREADS == RADIX_BINS (thread t owns bin t).
#pragma once

// ---- cluster exchange: C == 1 is a CTA of its own (plain loads, __syncthreads) -----------
#if !defined(LLMC_HOST_EMULATION) && (!defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900)
#define SAMPLE_HAS_CLUSTER 1
__device__ __forceinline__ unsigned remote_addr(const void* p, unsigned rank) {
    unsigned a, ra;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(ra) : "r"(a), "r"(rank));
    return ra;
}
__device__ __forceinline__ unsigned remote_ld(const unsigned* p, unsigned rank) {
    unsigned v;
    asm volatile("ld.shared::cluster.u32 %0, [%1];" : "=r"(v) : "r"(remote_addr(p, rank)) : "memory");
    return v;
}
__device__ __forceinline__ int remote_ld(const int* p, unsigned rank) {
    return (int)remote_ld(reinterpret_cast<const unsigned*>(p), rank);
}
__device__ __forceinline__ float remote_ld(const float* p, unsigned rank) {
    return __uint_as_float(remote_ld(reinterpret_cast<const unsigned*>(p), rank));
}
__device__ __forceinline__ unsigned long long remote_ld(const unsigned long long* p,
                                                        unsigned rank) {
    unsigned long long v;
    asm volatile("ld.shared::cluster.u64 %0, [%1];" : "=l"(v) : "r"(remote_addr(p, rank)) : "memory");
    return v;
}
#endif

// Every thread of the row's C CTAs has arrived; their shared-memory writes are visible.
template <int C>
__device__ __forceinline__ void row_sync() {
#ifdef SAMPLE_HAS_CLUSTER
    if constexpr (C > 1) {
        asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
        asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
        return;
    }
#endif
    __syncthreads();
}

// `*p` in the shared memory of the row's CTA `rank`.
template <int C, typename T>
__device__ __forceinline__ T row_ld(const T* p, int rank) {
#ifdef SAMPLE_HAS_CLUSTER
    if constexpr (C > 1) return remote_ld(p, (unsigned)rank);
#endif
    return *p;
}

// ---- values, keys, masses ------------------------------------------------------------------
__device__ __forceinline__ unsigned order_key(float f) {
    unsigned u = __float_as_uint(f);
    if (u == 0x80000000u) u = 0u;  // -0 == +0, as the reference's float comparisons
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ bool is_finite(float f) {
    return (__float_as_uint(f) & 0x7f800000u) != 0x7f800000u;
}

// floor(expf(l - M) * 2**32): an exact integer <= 2**32 (e * 2**32 is exact in float32).
__device__ __forceinline__ unsigned long long mass_of(float l, float M) {
    return (unsigned long long)(expf(__fsub_rn(l, M)) * 4294967296.0f);
}

// ---- radix select ----------------------------------------------------------------------------
// Exclusive suffix sum over the block's threads (thread t: sum of x over threads > t).
__device__ __forceinline__ unsigned long long suffix_excl(unsigned long long x) {
    __shared__ unsigned long long wsum[SAMPLE_WARPS];
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    unsigned long long inc = x;
    for (int o = 1; o < 32; o <<= 1) {
        const unsigned long long y = __shfl_down_sync(0xffffffffu, inc, o);
        if (lane + o < 32) inc += y;
    }
    __syncthreads();  // the previous call's readers are done
    if (lane == 0) wsum[w] = inc;
    __syncthreads();
    unsigned long long after = 0;
    for (int j = w + 1; j < SAMPLE_WARPS; ++j) after += wsum[j];
    return inc - x + after;
}

// Exchange buffers alternate: a CTA writes buffer b only after the row sync that follows
// every CTA's reads of b's previous contents (two exchanges back).
struct RadixHist {
    unsigned cnt[2][RADIX_BINS];
    unsigned long long mass[2][RADIX_BINS];
};

#define RADIX_NONE 0xffffffffu  // a lane without a candidate key

// *m += q with 32-bit shared atomics: the low word, then the high word plus the carry the
// low add produced, only when that is not 0 (q <= 2**32, so mostly it is): each add detects
// its own wrap, so the sum is exact in any order. Against one 64-bit atomic: 1.803 against
// 1.923 ms for the whole top-p kernel at 512 x 128,256 on the H200 (scripts/
// sampling_variants.py, 2026-12-02, with the high word always added; same tokens).
__device__ __forceinline__ void mass_add(unsigned long long* m, unsigned long long q) {
    unsigned* w = reinterpret_cast<unsigned*>(m);  // little-endian: w[0] low, w[1] high
    const unsigned lo = (unsigned)q, old = atomicAdd(w, lo);
    const unsigned hi = (unsigned)(q >> 32) + (old + lo < old ? 1u : 0u);
    if (hi) atomicAdd(w + 1, hi);
}

// Adds this lane's key (digit d; RADIX_NONE: none) to the bin counts and masses, one
// 32-bit atomic per lane (and mass_add). Aggregating a warp's equal digits first (one
// __match_any_sync and two __reduce_add_sync, then one atomic per distinct digit: v3/v4)
// was the slower choice: the match costs more than the atomics it saves, even in round 0,
// whose top-byte digits put most keys of a row in a dozen bins (the whole top-p kernel at
// 512 x 128,256 on the H200: 1.804 ms with the match, 0.879 ms without; same tokens).
template <bool MASS>
__device__ __forceinline__ void hist_add(unsigned* cnt, unsigned long long* mass, unsigned d,
                                         unsigned long long q) {
    if (d != RADIX_NONE) {
        atomicAdd(&cnt[d], 1u);
        if (MASS) mass_add(&mass[d], q);
    }
}

// One radix round: this CTA's histogram of digit (key >> shift) & 255 over the keys >= lo
// whose bits above the digit equal `prefix` (masses when MASS), summed over the row's CTAs.
// Thread t gets bin t's count and mass.
template <int C, bool MASS, typename ValFn>
__device__ __forceinline__ void radix_round(RadixHist& h, int& xchg, int rank, int n, ValFn val,
                                            unsigned lo, unsigned prefix, int shift, float M,
                                            unsigned& cnt, unsigned long long& mass) {
    const int b = xchg++ & 1;
    const unsigned hi_mask = shift == 24 ? 0u : ~0u << (shift + 8);
    h.cnt[b][threadIdx.x] = 0u;
    if (MASS) h.mass[b][threadIdx.x] = 0ull;
    __syncthreads();
    for (int base = 0; base < n; base += SAMPLE_THREADS) {  // the same trip count per warp
        const int i = base + (int)threadIdx.x;
        unsigned d = RADIX_NONE;
        unsigned long long q = 0ull;
        if (i < n) {
            const float l = val(i);
            const unsigned key = order_key(l);
            if (key >= lo && (key & hi_mask) == prefix) {
                d = (key >> shift) & 255u;
                if (MASS) q = mass_of(l, M);
            }
        }
        // a warp with no candidate adds nothing: most warps after round 0, whose digits
        // narrowed the candidates to one bin (one vote, then no divergent branch)
        if (__any_sync(0xffffffffu, d != RADIX_NONE)) hist_add<MASS>(h.cnt[b], h.mass[b], d, q);
    }
    row_sync<C>();  // every CTA's histogram is complete
    // all C loads issued before the first add (a remote load is a few hundred cycles)
    unsigned cs[C];
    unsigned long long ms[C];
#pragma unroll
    for (int r = 0; r < C; ++r) {
        cs[r] = row_ld<C>(&h.cnt[b][threadIdx.x], r);
        ms[r] = MASS ? row_ld<C>(&h.mass[b][threadIdx.x], r) : 0ull;
    }
    cnt = 0u;
    mass = 0ull;
#pragma unroll
    for (int r = 0; r < C; ++r) {
        cnt += cs[r];
        mass += ms[r];
    }
}

// The one thread whose bin holds the threshold (`mine`) publishes its digit and `after`;
// every thread appends the digit to `prefix` and takes `after` as the new `above`.
template <typename T>
__device__ __forceinline__ void take_bin(bool mine, T after, int shift, unsigned& prefix,
                                         T& above) {
    __shared__ unsigned digit;
    __shared__ T sel;
    if (mine) {
        digit = threadIdx.x;
        sel = after;
    }
    __syncthreads();
    prefix |= digit << shift;
    above = sel;
    __syncthreads();
}

// kth = the largest key x with count(key >= x) >= k (0 < k < V).
template <int C, typename ValFn>
__device__ __forceinline__ unsigned select_top_k(RadixHist& h, int& xchg, int rank, int n, ValFn val,
                                                 int k) {
    unsigned prefix = 0u, above = 0u;  // above: count of keys above the prefix's region
    for (int shift = 24; shift >= 0; shift -= 8) {
        unsigned cnt;
        unsigned long long unused;
        radix_round<C, false>(h, xchg, rank, n, val, 0u, prefix, shift, 0.f, cnt, unused);
        const unsigned after = above + (unsigned)suffix_excl(cnt);  // keys in bins > t
        // the bin holding the k-th largest: count(>= bin t) >= k > count(> bin t)
        take_bin(after + cnt >= (unsigned)k && after < (unsigned)k, after, shift, prefix, above);
    }
    return prefix;
}

// tau = the smallest key x >= kth with double(mass(kth <= key, key > x)) < target.
template <int C, typename ValFn>
__device__ __forceinline__ unsigned select_top_p(RadixHist& h, int& xchg, int rank, int n, ValFn val,
                                                 unsigned kth, float M, float p) {
    __shared__ unsigned sel_low, sel_low_count;
    __shared__ double sel_target;
    unsigned prefix = 0u;
    unsigned long long above = 0ull;  // mass of the kept keys above the prefix's region
    double target = 0.0;
    for (int shift = 24; shift >= 0; shift -= 8) {
        unsigned cnt;
        unsigned long long mass;
        radix_round<C, true>(h, xchg, rank, n, val, kth, prefix, shift, M, cnt, mass);
        const unsigned long long after = above + suffix_excl(mass);  // mass in bins > t
        const unsigned cnt_after = (unsigned)suffix_excl(cnt);
        if (shift == 24) {  // round 0 sees every kept key: its total is Z
            if (threadIdx.x == 0) sel_target = (double)p * (double)(after + mass);
            __syncthreads();
            target = sel_target;
        }
        // bins whose largest key x has mass(> x) < target: t >= t0 (monotone in t)
        const bool ok = (double)after < target;
        const bool ok_below = threadIdx.x > 0 && (double)(after + mass) < target;
        if (ok && !ok_below) {
            sel_low = threadIdx.x;
            sel_low_count = cnt_after + cnt;  // keys in bins >= t0
        }
        __syncthreads();
        // the lowest non-empty bin >= t0: no keys in t0..t-1
        const bool mine = threadIdx.x >= sel_low && cnt > 0u && cnt_after + cnt == sel_low_count;
        take_bin(mine, after, shift, prefix, above);
    }
    return prefix;
}
