"""How many bytes in flight the weight stream of a GEMV needs on the H200, and whether the
tensor-core GEMVs' access pattern costs bandwidth by itself: a read-only kernel (CuPy) that
streams a 1 GiB matrix with the lane layout of cuda/gemv_wo.cu / gemv_fp8.cu (4 lanes x 16
bytes of 8 rows per instruction) or of cuda/gemv.cu (32 lanes x 16 bytes of one row), with
``loads`` 16-byte loads in flight per thread, and reports GB/s (no arithmetic on the data
beyond an XOR that keeps the loads alive). GPU only; results as JSON.

- ``lpr``: lanes per row (4: the mma tiles' pattern; 32: a row per warp instruction);
- ``vpl``: consecutive 16-byte vectors a lane reads of its row per step;
- ``rpw``: row groups a warp reads per step (loads in flight a thread = rpw x vpl).

    python3 scripts/gemv_read_pattern.py out.json
"""

from __future__ import annotations

import json
import sys

import cupy as cp

SRC = r"""
extern "C" __global__ void __launch_bounds__(512, 1) rd(const unsigned char* __restrict__ w,
    int rows, int rowbytes, int lpr, int vpl, int rpw, unsigned int* out) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int rpg = 32 / lpr, rows_w = rpg * rpw, units = rows / rows_w, chunk = lpr * vpl * 16;
  unsigned int acc = 0;
  for (int u = blockIdx.x * 16 + warp; u < units; u += gridDim.x * 16) {
    const int r0 = u * rows_w + lane / lpr, t = lane % lpr;
    for (int off = 0; off < rowbytes; off += chunk) {
      uint4 v[16];
      #pragma unroll
      for (int j = 0; j < 16; ++j) {
        if (j < rpw * vpl) {
          const int rr = r0 + (j / vpl) * rpg, vv = j % vpl;
          const unsigned char* p = w + (long long)rr * rowbytes + off + (t * vpl + vv) * 16;
          asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                       : "=r"(v[j].x), "=r"(v[j].y), "=r"(v[j].z), "=r"(v[j].w) : "l"(p));
        }
      }
      #pragma unroll
      for (int j = 0; j < 16; ++j) if (j < rpw * vpl) acc ^= v[j].x ^ v[j].y ^ v[j].z ^ v[j].w;
    }
  }
  out[blockIdx.x * 512 + threadIdx.x] = acc;
}
"""
PATTERNS = [  # (lpr, vpl, rpw)
    (4, 1, 2), (4, 2, 2), (4, 4, 2), (4, 1, 4), (4, 2, 4), (4, 4, 4), (4, 8, 2), (8, 1, 2),
    (8, 2, 2), (16, 1, 2), (16, 2, 4), (32, 1, 8), (32, 2, 4), (32, 4, 2), (32, 8, 1),
]  # fmt: skip
ROW_BYTES = (2048, 4096, 7168)  # the 8B's int4 rows (K = 4096), int8 / fp8, int4 down


def main(path: str) -> None:
    kern = cp.RawKernel(SRC, "rd")
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    res = []
    for rowbytes in ROW_BYTES:
        rows = (1 << 30) // rowbytes // 512 * 512
        w = cp.random.randint(0, 255, size=rows * rowbytes, dtype=cp.uint8)
        out = cp.zeros(sms * 512, dtype=cp.uint32)
        for lpr, vpl, rpw in PATTERNS:
            if rowbytes % (lpr * vpl * 16):
                continue
            args = (w, cp.int32(rows), cp.int32(rowbytes), cp.int32(lpr), cp.int32(vpl),
                    cp.int32(rpw), out)  # fmt: skip
            kern((sms,), (512,), args)
            start, end = cp.cuda.Event(), cp.cuda.Event()
            start.record()
            for _ in range(5):
                kern((sms,), (512,), args)
            end.record()
            end.synchronize()
            ms = cp.cuda.get_elapsed_time(start, end) / 5
            row = dict(rowbytes=rowbytes, lpr=lpr, vpl=vpl, rpw=rpw, loads=rpw * vpl,
                       GBps=round(rows * rowbytes / ms / 1e6))  # fmt: skip
            res.append(row)
            print(row, flush=True)
        del w
    with open(path, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "gemv_read_pattern.json")
