// wo_ring.cuh: the shared-memory ring of cuda/gemv_wo.cu's *_ring kernels (its header
// comment has the design): every lane streams its own code vectors (and the scale words of
// its k-steps) into its own slots of a per-warp ring of R stages (one k-step each) with
// cp.async, R - 1 stages in flight while it unpacks one, so the bytes in flight are
// R - 1 k-steps x 32 bytes x 512 threads per SM, whatever the registers hold.
//
// Per warp: R stages of CH 512-byte chunks, chunk c of a stage lane-major (16 bytes a lane:
// one LDS.128 / cp.async per lane, conflict-free): chunks 0, 1 the codes of rows g, g + 8;
// kstep and deq: chunk 2 = the raw scale / offset words {s(g), o(g), s(g+8), o(g+8)} of the
// group (a) of the lane's columns, and where a code vector spans two groups (deq, 4-bit,
// gs % 32 != 0: CH = 4) chunk 3 the same for the group (b) of its second half.
// A 16-bit scale travels in its aligned 32-bit word (cp.async copies 4, 8 or 16
// bytes), the consumer picks the half by the element's address; the word never leaves the
// allocation's 4-byte granule (the host asks for 4-byte aligned scale / offset tensors).
//
// A lane reads only the slots it filled itself, so cp.async.wait_group is all the
// synchronisation there is; a slot is refilled only after the k-step read from it has been
// computed (wo_consumed: its values are in the sums). One commit group per k-step, empty past the warp's share,
// so "the oldest stage landed" is always wait_group(R - 1).
#pragma once
#include "wo_codes.cuh"

#define WO_STAGES_SHIFT 8  // flags >> 8: ring stages R (the *_ring kernels)
#define WO_MAX_STAGES 16

// Chunks of a stage (llmc.cuda.gemv_wo_ops.wo_ring_stage_bytes): 2 of codes + the scales'.
template <int BITS, int SMODE>
__device__ __forceinline__ int wo_ring_chunks(int gs) {
    if constexpr (SMODE == WO_ROW) return 2;
    if constexpr (SMODE == WO_KSTEP) return 3;
    return gs % wo_vb<BITS>() == 0 ? 3 : 4;  // deq: one group a code vector, or two
}

// ---- cp.async (host stand-ins under LLMC_HOST_EMULATION: copies at once) --------------
#ifndef LLMC_HOST_EMULATION
__device__ __forceinline__ unsigned wo_saddr(const void* p) {  // as the other families do
    unsigned r;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(r) : "l"(p));
    return r;
}
#endif

// 16 bytes (or, `full` false, 16 zeros: the row's end) global -> shared, L2 only;
// `wide`: the L2 fetches the 256 bytes around them (the lane's next k-steps, wanted soon).
__device__ __forceinline__ void wo_cp16(void* s, const void* g, bool full, bool wide) {
#ifdef LLMC_HOST_EMULATION
    (void)wide;
    if (full) std::memcpy(s, g, 16);
    else std::memset(s, 0, 16);
#else
    const unsigned sa = wo_saddr(s);
    if (wide) {
        asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;" ::"r"(sa), "l"(g),
                     "r"(full ? 16 : 0)
                     : "memory");
    } else {
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(sa), "l"(g),
                     "r"(full ? 16 : 0)
                     : "memory");
    }
#endif
}

// The aligned 32-bit word holding the 2- or 4-byte value at g.
__device__ __forceinline__ void wo_cp4(void* s, const unsigned char* g) {
    const unsigned char* w =
        reinterpret_cast<const unsigned char*>(reinterpret_cast<unsigned long long>(g) & ~3ull);
#ifdef LLMC_HOST_EMULATION
    std::memcpy(s, w, 4);
#else
    const unsigned sa = wo_saddr(s);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(sa), "l"(w) : "memory");
#endif
}

__device__ __forceinline__ void wo_commit() {
#ifndef LLMC_HOST_EMULATION
    asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}

// All but the newest n commit groups of this thread have landed (n < WO_MAX_STAGES; the
// instruction takes an immediate, the switch is warp-uniform).
__device__ __forceinline__ void wo_wait(int n) {
#ifdef LLMC_HOST_EMULATION
    (void)n;
#else
#define WO_WAIT_CASE(N) \
    case N: asm volatile("cp.async.wait_group " #N ";" ::: "memory"); break;
    switch (n) {
        WO_WAIT_CASE(0) WO_WAIT_CASE(1) WO_WAIT_CASE(2) WO_WAIT_CASE(3) WO_WAIT_CASE(4)
        WO_WAIT_CASE(5) WO_WAIT_CASE(6) WO_WAIT_CASE(7) WO_WAIT_CASE(8) WO_WAIT_CASE(9)
        WO_WAIT_CASE(10) WO_WAIT_CASE(11) WO_WAIT_CASE(12) WO_WAIT_CASE(13) WO_WAIT_CASE(14)
        WO_WAIT_CASE(15)
        default: asm volatile("cp.async.wait_group 0;" ::: "memory");
    }
#undef WO_WAIT_CASE
#endif
}

// ---- one stage --------------------------------------------------------------------------
// Byte address of scale / offset element gi of a row (f16: 2 bytes, f32: 4).
__device__ __forceinline__ const unsigned char* wo_sp(const unsigned char* row, int gi, bool f32) {
    return row + (long long)gi * (f32 ? 4 : 2);
}

// The raw value (f32 bits, or the f16 bits in the low half) at p, from its copied word.
__device__ __forceinline__ unsigned int wo_pick(unsigned int word, const unsigned char* p,
                                                bool f32) {
    if (f32) return word;
    return (reinterpret_cast<unsigned long long>(p) & 2ull) ? word >> 16 : word & 0xffffu;
}

// Issue k-step ks of the lane into its slot (lane base of the stage); the caller commits.
template <int BITS, int SMODE>
__device__ __forceinline__ void wo_ring_issue(unsigned char* slot, const WoLane& L, int ks) {
    const bool full = ks * 64 + 16 * L.t < L.rowbytes;  // rowbytes % 16 == 0: all or none
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        wo_cp16(slot + 512 * h, full ? L.c[h] + ks * 64 : L.c[h], full, L.prefetch);
    }
    if constexpr (SMODE != WO_ROW) {
        int ga, gb;
        wo_groups<BITS, SMODE>(L, ks, ga, gb);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            unsigned char* d = slot + 1024 + 8 * h;
            wo_cp4(d, wo_sp(L.s[h], ga, L.f32));
            if (L.has_o) wo_cp4(d + 4, wo_sp(L.o[h], ga, L.f32));
            if constexpr (SMODE == WO_DEQ) {
                if (gb != ga) {  // only where the stage has chunk 3
                    wo_cp4(d + 512, wo_sp(L.s[h], gb, L.f32));
                    if (L.has_o) wo_cp4(d + 516, wo_sp(L.o[h], gb, L.f32));
                }
            }
        }
    }
}

// Raw scales / offsets of group gi of rows g, g + 8 from a landed chunk {s(g), o(g), s(g+8),
// o(g+8)} (0: no offsets).
__device__ __forceinline__ void wo_ring_scales(const unsigned char* chunk, const WoLane& L,
                                               int gi, unsigned int (&s)[2],
                                               unsigned int (&o)[2]) {
    const v4u w = *reinterpret_cast<const v4u*>(chunk);
    const unsigned int ws[2] = {w.x, w.z}, wo[2] = {w.y, w.w};
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        s[h] = wo_pick(ws[h], wo_sp(L.s[h], gi, L.f32), L.f32);
        o[h] = L.has_o ? wo_pick(wo[h], wo_sp(L.o[h], gi, L.f32), L.f32) : 0u;
    }
}

// Codes and raw scales of k-step ks back from its landed slot (the values wo_load_batch
// would have loaded).
template <int BITS, int SMODE>
__device__ __forceinline__ void wo_ring_read(const unsigned char* slot, const WoLane& L, int ks,
                                             v4u (&cv)[2], WoScales<SMODE>& sc) {
#pragma unroll
    for (int h = 0; h < 2; ++h) cv[h] = *reinterpret_cast<const v4u*>(slot + 512 * h);
    if constexpr (SMODE != WO_ROW) {
        int ga, gb;
        wo_groups<BITS, SMODE>(L, ks, ga, gb);
        unsigned int s[2], o[2];
        wo_ring_scales(slot + 1024, L, ga, s, o);
#pragma unroll
        for (int h = 0; h < 2; ++h) sc.s[h][0] = s[h], sc.o[h][0] = o[h];
        if constexpr (SMODE == WO_DEQ) {
            if (gb != ga) wo_ring_scales(slot + 1536, L, gb, s, o);
#pragma unroll
            for (int h = 0; h < 2; ++h) sc.s[h][1] = s[h], sc.o[h][1] = o[h];
        }
    }
}

// ---- the stream -------------------------------------------------------------------------
// A slot is refilled only once the sums that consumed its values are ready: every value read
// from it (codes, scales) feeds tot, so no later cp.async can land before those reads (the
// PTX model does not order a thread's cp.async after its own earlier shared loads).
__device__ __forceinline__ void wo_consumed(float (&tot)[4]) {
#ifndef LLMC_HOST_EMULATION
    asm volatile("" : "+f"(tot[0]), "+f"(tot[1]), "+f"(tot[2]), "+f"(tot[3])::"memory");
#else
    (void)tot;
#endif
}

// The lane's base in stage 0 of its warp's ring (R stages of `stage` bytes per warp).
__device__ __forceinline__ unsigned char* wo_ring_lane(unsigned char* ring, int R, int stage,
                                                       int warp, int lane) {
    return ring + (long long)warp * R * stage + 16 * lane;
}

// Fill the ring with k-steps s0 .. s0 + R - 1 of the warp's share [s0, s1) (R groups).
template <int BITS, int SMODE>
__device__ __forceinline__ void wo_ring_fill(unsigned char* lane0, int R, int stage,
                                             const WoLane& L, int s0, int s1) {
    for (int i = 0; i < R; ++i) {
        if (s0 + i < s1) wo_ring_issue<BITS, SMODE>(lane0 + i * stage, L, s0 + i);
        wo_commit();
    }
}

// The warp's k-steps [s0, s1) from a filled ring, in order; each slot refilled with the
// k-step R ahead once its own has been computed.
template <int BITS, int SMODE>
__device__ __forceinline__ void wo_ring_stream(float (&tot)[4], unsigned char* lane0, int R,
                                               int stage, const WoLane& L,
                                               const unsigned char* xrow, int s0,
                                               int s1, const WoSums& xs, int t4) {
    int slot = 0;
    for (int ks = s0; ks < s1; ++ks) {
        wo_wait(R - 1);  // k-step ks landed
        unsigned char* sp = lane0 + slot * stage;
        v4u cv[2];
        WoScales<SMODE> sc;
        wo_ring_read<BITS, SMODE>(sp, L, ks, cv, sc);
        wo_mma_kstep<BITS, SMODE>(tot, cv, sc, L, xrow, ks, xs, t4);
        wo_consumed(tot);
        if (ks + R < s1) wo_ring_issue<BITS, SMODE>(sp, L, ks + R);
        wo_commit();
        slot = slot + 1 == R ? 0 : slot + 1;
    }
}
