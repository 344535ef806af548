// gemv_skeleton.cuh: the work split of the tensor-core small-step GEMVs (cuda/gemv_fp8.cu,
// cuda/gemv_wo.cu), one home: a *tile* is 16 weight rows (gate_up, MODE 1: 8 gate rows + the
// 8 matching up rows), tiles round-robin over the CTAs (grid <= SMs, <= tiles), GEMV_WARPS
// (16) tiles per round; with cr < 16 tiles in a round the round's k-steps are split evenly
// over all 16 warps (the flat split below) and the partial sums added through shared memory.
// No includes and no PTX: the includer provides min / blockIdx / gridDim (CUDA, or the host
// emulators of tests/cuda).
#pragma once

#define GEMV_WARPS 16

// Tiles of this CTA (tile = blockIdx.x + i * gridDim.x); <= 0 when the grid has more CTAs.
__device__ __forceinline__ int gemv_cta_tiles(int tiles) {
    return (tiles - (int)blockIdx.x + (int)gridDim.x - 1) / (int)gridDim.x;
}

// Weight row r (0..15) of tile `tile` (clamped in range; the caller guards stores).
template <int MODE>
__device__ __forceinline__ int gemv_tile_row(int tile, int r, int n_out) {
    if constexpr (MODE == 1) {
        const int j = min(tile * 8 + (r & 7), n_out - 1);
        return r < 8 ? j : n_out + j;
    } else {
        return min(tile * 16 + r, n_out - 1);
    }
}

// ---- the flat split ---------------------------------------------------------------------
// A round's cr tiles x ks k-steps as one range of units, warp w taking units
// [w U / 16, (w + 1) U / 16) (U = cr ks): every warp busy whatever cr (the split by tiles
// before it, 16 / cr warps a tile, left 16 % cr warps idle: gate_up's 13-14 tiles a CTA
// ran on 13-14 of the 16 warps). A share is at
// most two segments (U / 16 <= ks): the tail of one tile and the head of the next. The warp
// whose share holds a tile's k-step 0 owns that tile (at most one a warp): it adds the
// partial sums of the later warps that cover the tile (in warp order) and stores it. When
// cr divides 16 and 16 / cr divides ks the shares are that split's (the same sums, bits).
struct GemvSeg {
    int tile, s0, s1;  // tile index, k-steps [s0, s1) of it
};

struct GemvShare {
    GemvSeg seg[2];
    int n;    // segments (0..2)
    int own;  // the segment whose tile this warp owns, -1: none
    int lt_own;  // that tile's index in the round
    bool whole;  // cr == 16: every share one whole tile (no partial sums, no barrier)
};

__device__ __forceinline__ GemvShare gemv_share(int r, int c, int ks, int warp) {
    GemvShare sh;
    const int cr = min(GEMV_WARPS, c - r * GEMV_WARPS);
    const int U = cr * ks, u1 = (warp + 1) * U / GEMV_WARPS;
    int u = warp * U / GEMV_WARPS;
    sh.n = 0, sh.own = -1, sh.lt_own = -1;
    sh.whole = cr == GEMV_WARPS;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        sh.seg[i] = GemvSeg{0, 0, 0};
        if (u < u1) {
            const int lt = u / ks, e = min(u1, (lt + 1) * ks);
            sh.seg[i] = GemvSeg{(int)blockIdx.x + (r * GEMV_WARPS + lt) * (int)gridDim.x,
                                u - lt * ks, e - lt * ks};
            if (u == lt * ks) sh.own = i, sh.lt_own = lt;
            sh.n = i + 1;
            u = e;
        }
    }
    return sh;
}

// The owner's total of its tile into acc[sh.own] (others: unchanged). Called by every thread
// of the CTA (barrier inside unless sh.whole); gemv_share_done ends the round.
__device__ __forceinline__ void gemv_share_add(float (&acc)[2][4], float (*part)[4][32],
                                               const GemvShare& sh, int r, int c, int ks,
                                               int warp, int lane) {
    if (sh.whole) return;  // CTA-uniform
    const int np = sh.own == 0 ? -1 : 0;  // the segment others need (seg 0 when not owned)
    if (np == 0 && sh.n > 0) {
#pragma unroll
        for (int j = 0; j < 4; ++j) part[warp][j][lane] = acc[0][j];
    }
    __syncthreads();
    if (sh.own >= 0) {
        const int cr = min(GEMV_WARPS, c - r * GEMV_WARPS), U = cr * ks;
        const int end = (sh.lt_own + 1) * ks;  // the owned tile's units end here
        float t[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) t[j] = sh.own == 0 ? acc[0][j] : acc[1][j];
        for (int v = warp + 1; v < GEMV_WARPS; ++v) {
            const int v0 = v * U / GEMV_WARPS;
            if (v0 >= end) break;
            if (v0 < (v + 1) * U / GEMV_WARPS) {  // a non-empty share starting in the tile
#pragma unroll
                for (int j = 0; j < 4; ++j) t[j] += part[v][j][lane];
            }
        }
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            if (sh.own == 0) acc[0][j] = t[j];
            else acc[1][j] = t[j];
        }
    }
}

__device__ __forceinline__ void gemv_share_done(const GemvShare& sh) {
    if (!sh.whole) __syncthreads();  // part is rewritten by the next round
}
