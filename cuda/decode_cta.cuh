// decode_cta.cuh: the CUDA-core pass of one decode-attention CTA over its keys (included
// by decode_attention.cu after its NQ / NKV / HD / G / U macros).
//
// LPK lanes share one key (each lane owns DPL = HD / LPK dims), so a warp streams
// 32 / LPK keys at once, U keys per stream per step; every stream keeps its own online
// softmax, merged across lanes at the end (attend_cta_simt), each warp's state written to
// shared memory for the kernel to combine.  Any dtype, head_dim and group size; K/V of
// the dtype or e4m3 codes (converted once per element, exactly).
#pragma once

// Lanes per key: the fewest that keep G * DPL <= 32 floats per lane, with each lane's
// slice a whole number of 32-bit words (EB: bytes per cache element).
template <int EB>
__host__ __device__ constexpr bool lpk_ok(int l) {
    return HD % l == 0 && ((HD / l) * EB) % 4 == 0;
}
template <int EB>
__host__ __device__ constexpr int pick_lpk() {
    for (int l = 1; l <= 32; l *= 2)
        if (lpk_ok<EB>(l) && (HD / l) * G <= 32) return l;
    int best = 1;
    for (int l = 1; l <= 32; l *= 2)
        if (lpk_ok<EB>(l)) best = l;
    return best;
}
// The lane layout for cache element type cache_t.
template <typename cache_t>
struct KeyLanes {
    static constexpr int lpk = pick_lpk<(int)sizeof(cache_t)>();
    static constexpr int dpl = HD / lpk;  // dims per lane
    static constexpr int kg = 32 / lpk;   // keys per warp at once
    static constexpr int words = dpl * (int)sizeof(cache_t) / 4;
};

// Raw 32-bit words of a lane's slice (widest aligned vector loads).
template <int WORDS>
__device__ __forceinline__ void load_words(const void* p, unsigned* w) {
    if constexpr (WORDS % 4 == 0) {
#pragma unroll
        for (int i = 0; i < WORDS; i += 4) {
            const v4u v = reinterpret_cast<const v4u*>(p)[i / 4];
            w[i] = v.x; w[i + 1] = v.y; w[i + 2] = v.z; w[i + 3] = v.w;
        }
    } else if constexpr (WORDS % 2 == 0) {
#pragma unroll
        for (int i = 0; i < WORDS; i += 2) {
            const v2u v = reinterpret_cast<const v2u*>(p)[i / 2];
            w[i] = v.x; w[i + 1] = v.y;
        }
    } else {
#pragma unroll
        for (int i = 0; i < WORDS; ++i) w[i] = reinterpret_cast<const unsigned*>(p)[i];
    }
}
// Element e of a 16- or 32-bit slice held in words w.
__device__ __forceinline__ float word_elem(const unsigned* w, int e) {
#if LLMC_DTYPE == 0
    return __uint_as_float(w[e]);
#elif LLMC_DTYPE == 2
    return __uint_as_float((e & 1) ? (w[e >> 1] & 0xffff0000u) : (w[e >> 1] << 16));
#else
    return to_float((unsigned short)((e & 1) ? (w[e >> 1] >> 16) : (w[e >> 1] & 0xffffu)));
#endif
}

// A lane's slice of one key in float: fp8 codes are converted once into f (exact); 16- and
// 32-bit values are read from the words where they are used (a shift or a mask, cheaper
// than holding the floats in registers).
template <typename cache_t, int DPL_>
struct SliceValues {
    static constexpr bool convert = sizeof(cache_t) == 1;
    float f[convert ? DPL_ : 1];
    __device__ __forceinline__ void prepare(const unsigned* w) {
        if constexpr (convert) {
#pragma unroll
            for (int i = 0; i < DPL_ / 4; ++i) fp8x4_to_float(w[i], f + 4 * i);
        }
    }
    __device__ __forceinline__ float get(const unsigned* w, int d) const {
        if constexpr (convert) {
            return f[d];
        } else {
            return word_elem(w, d);
        }
    }
};


// Online-softmax attention of this thread's streams over keys [kbeg, kend).  POW2: the
// block size is 1 << bs_shift (index by shift and mask instead of a division per key).
template <bool POW2, int NWARPS, typename cache_t>
__device__ __forceinline__ void attend_keys(
    const cache_t* __restrict__ k_cache, const cache_t* __restrict__ v_cache,
    const int* __restrict__ bt, int block_size, int bs_shift, int kvh, int sub, int stream,
    int kbeg, int kend, const float (&qf)[G][KeyLanes<cache_t>::dpl], float (&m)[G],
    float (&l)[G], float (&acc)[G][KeyLanes<cache_t>::dpl]) {
    using KL = KeyLanes<cache_t>;
    constexpr int lpk = KL::lpk, dpl = KL::dpl, ns = NWARPS * KL::kg, words = KL::words;
    const long long row_stride = (long long)NKV * HD;
    for (int base = kbeg; base < kend; base += ns * U) {
        // Issue every K and V load of this step before any use (bytes in flight).
        unsigned kw[U][words], vw[U][words];
        bool valid[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int j = base + u * ns + stream;
            valid[u] = j < kend;
            if (valid[u]) {
                const int bi = POW2 ? (j >> bs_shift) : (j / block_size);
                const int bo = j - bi * block_size;
                const long long off = ((long long)bt[bi] * block_size + bo) * row_stride +
                                      kvh * HD + sub * dpl;
                load_words<words>(k_cache + off, kw[u]);
                load_words<words>(v_cache + off, vw[u]);
            } else {
#pragma unroll
                for (int i = 0; i < words; ++i) kw[u][i] = vw[u][i] = 0u;
            }
        }
        float sc[U][G];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            SliceValues<cache_t, dpl> kf;
            kf.prepare(kw[u]);
#pragma unroll
            for (int g = 0; g < G; ++g) {
                float a = 0.f;
#pragma unroll
                for (int d = 0; d < dpl; ++d) a = fmaf(qf[g][d], kf.get(kw[u], d), a);
#pragma unroll
                for (int o = lpk / 2; o > 0; o >>= 1) a += __shfl_xor_sync(0xffffffffu, a, o);
                sc[u][g] = valid[u] ? a : LLMC_NEG_INF;
            }
        }
        // Softmax update per head (sc becomes p), then P.V key by key, so that each V
        // slice is converted once for all G heads.
        bool live[G];
#pragma unroll
        for (int g = 0; g < G; ++g) {
            float mx = m[g];
#pragma unroll
            for (int u = 0; u < U; ++u) mx = fmaxf(mx, sc[u][g]);
            live[g] = mx != LLMC_NEG_INF;  // else nothing valid yet for this stream
            if (!live[g]) continue;
            const float alpha = exp2f(m[g] - mx);
            m[g] = mx;
            float psum = 0.f;
#pragma unroll
            for (int u = 0; u < U; ++u) {
                sc[u][g] = exp2f(sc[u][g] - mx);
                psum += sc[u][g];
            }
            l[g] = l[g] * alpha + psum;
#pragma unroll
            for (int d = 0; d < dpl; ++d) acc[g][d] *= alpha;
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            SliceValues<cache_t, dpl> vf;
            vf.prepare(vw[u]);
#pragma unroll
            for (int g = 0; g < G; ++g) {
                if (!live[g]) continue;
#pragma unroll
                for (int d = 0; d < dpl; ++d) acc[g][d] = fmaf(sc[u][g], vf.get(vw[u], d), acc[g][d]);
            }
        }
    }
}

// Merge the softmax states of the streams of one warp (lanes with the same `sub`).
template <typename cache_t>
__device__ __forceinline__ void merge_warp_streams(float (&m)[G], float (&l)[G],
                                                   float (&acc)[G][KeyLanes<cache_t>::dpl]) {
    using KL = KeyLanes<cache_t>;
#pragma unroll
    for (int o = 16; o >= KL::lpk; o >>= 1) {
#pragma unroll
        for (int g = 0; g < G; ++g) {
            const float mo = __shfl_xor_sync(0xffffffffu, m[g], o);
            const float lo = __shfl_xor_sync(0xffffffffu, l[g], o);
            const float mn = fmaxf(m[g], mo);
            const float fa = mn == LLMC_NEG_INF ? 0.f : exp2f(m[g] - mn);
            const float fb = mn == LLMC_NEG_INF ? 0.f : exp2f(mo - mn);
            l[g] = l[g] * fa + lo * fb;
#pragma unroll
            for (int d = 0; d < KL::dpl; ++d) {
                const float ao = __shfl_xor_sync(0xffffffffu, acc[g][d], o);
                acc[g][d] = acc[g][d] * fa + ao * fb;
            }
            m[g] = mn;
        }
    }
}

// One CTA's pass over keys [kbeg, kend) of token t for the G query heads of kv head kvh:
// q (pre-scaled into the log2 domain) against the keys in streams of LPK lanes, the
// streams' online-softmax states merged per warp, and each warp's state written to
// sm_ml / sm_acc (max, sum; unnormalised acc) for decode_attention.cu to combine after a
// __syncthreads().
template <int NWARPS, typename cache_t>
__device__ __forceinline__ void attend_cta_simt(
    const scalar_t* __restrict__ q, const cache_t* __restrict__ k_cache,
    const cache_t* __restrict__ v_cache, const int* __restrict__ bt, int block_size,
    int bs_shift, int t, int kvh, float scale_log2, int kbeg, int kend,
    float (&sm_ml)[NWARPS][G][2], float (&sm_acc)[NWARPS][G][HD]) {
    using KL = KeyLanes<cache_t>;
    constexpr int lpk = KL::lpk, dpl = KL::dpl, kg = KL::kg;
    constexpr int dv = vec_width_for(dpl);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int sub = lane % lpk, grp = lane / lpk;
    const int stream = warp * kg + grp;

    float qf[G][dpl];
#pragma unroll
    for (int g = 0; g < G; ++g) {
#pragma unroll
        for (int d = 0; d < dpl; d += dv)
            load_vec<dv>(q + ((long long)t * NQ + kvh * G + g) * HD + sub * dpl + d, qf[g] + d);
#pragma unroll
        for (int d = 0; d < dpl; ++d) qf[g][d] *= scale_log2;
    }
    float m[G], l[G], acc[G][dpl];
#pragma unroll
    for (int g = 0; g < G; ++g) {
        m[g] = LLMC_NEG_INF;
        l[g] = 0.f;
#pragma unroll
        for (int d = 0; d < dpl; ++d) acc[g][d] = 0.f;
    }
    if (bs_shift >= 0)
        attend_keys<true, NWARPS, cache_t>(k_cache, v_cache, bt, block_size, bs_shift, kvh, sub,
                                           stream, kbeg, kend, qf, m, l, acc);
    else
        attend_keys<false, NWARPS, cache_t>(k_cache, v_cache, bt, block_size, bs_shift, kvh, sub,
                                            stream, kbeg, kend, qf, m, l, acc);
    merge_warp_streams<cache_t>(m, l, acc);
    if (grp == 0) {
#pragma unroll
        for (int g = 0; g < G; ++g) {
            if (sub == 0) {
                sm_ml[warp][g][0] = m[g];
                sm_ml[warp][g][1] = l[g];
            }
#pragma unroll
            for (int d = 0; d < dpl; ++d) sm_acc[warp][g][sub * dpl + d] = acc[g][d];
        }
    }
}

