// gemv_skeleton.cuh: the work split of the tensor-core small-step GEMVs (cuda/gemv_fp8.cu,
// cuda/gemv_wo.cu), one home: a *tile* is 16 weight rows (gate_up, MODE 1: 8 gate rows + the
// 8 matching up rows), tiles round-robin over the CTAs (grid <= SMs, <= tiles), GEMV_WARPS
// (16) tiles per round; with cr < 16 tiles in a round, 16 / cr warps share each tile over
// contiguous shares of its k-steps and add their mma sums through shared memory (split-K).
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

// A warp's job in round r: tile, its share [s0, s1) of the k-steps among `split` warps.
struct GemvWork {
    int tile, split, part, s0, s1;  // part: this warp's index among the split
    bool active;
};

__device__ __forceinline__ GemvWork gemv_work(int r, int c, int ksteps, int warp) {
    GemvWork w;
    const int cr = min(GEMV_WARPS, c - r * GEMV_WARPS);  // tiles in this round
    w.split = GEMV_WARPS / cr;
    const int lt = warp / w.split;
    w.part = warp - lt * w.split;
    w.active = lt < cr;
    w.tile = (int)blockIdx.x + (r * GEMV_WARPS + lt) * (int)gridDim.x;
    w.s0 = w.part * ksteps / w.split;
    w.s1 = (w.part + 1) * ksteps / w.split;
    return w;
}

// Split-K: the first warp of each tile adds the other warps' shares (lane-wise, in warp
// order) to its acc. Called by every thread of the CTA (barrier inside when split > 1); the
// caller ends the round with gemv_split_done before `part` is written again.
__device__ __forceinline__ void gemv_split_add(float (&acc)[4], float (*part)[4][32],
                                               const GemvWork& w, int warp, int lane) {
    if (w.split > 1) {  // CTA-uniform
        if (w.active) {
#pragma unroll
            for (int j = 0; j < 4; ++j) part[warp][j][lane] = acc[j];
        }
        __syncthreads();
        if (w.active && w.part == 0) {
            for (int s = 1; s < w.split; ++s) {
#pragma unroll
                for (int j = 0; j < 4; ++j) acc[j] += part[warp + s][j][lane];
            }
        }
    }
}

__device__ __forceinline__ void gemv_split_done(const GemvWork& w) {
    if (w.split > 1) __syncthreads();  // part is rewritten by the next round
}
