"""CPU model of prefill_attention_sm90.cu's shared-memory layouts, wgmma descriptors and
register fragments (the kernel runs only on an H100/H200; this is what can be checked here).

The kernel stores Q, K and V tiles as column blocks of 128-byte rows in the 128-byte swizzle
(``swz``) and gives wgmma descriptors (``make_desc``: start, LBO, SBO, SWIZZLE_128B). Here
both are ported to Python, and a decoder reads each k-step's operand back from the bytes the
way the PTX ISA's canonical layouts define them, as CUTLASS writes them (in 16-bit elements,
T = 8 per 16 bytes):

- K-major, 128B swizzle: ((8,m),(T,2)) : ((8T,SBO),(1,T))       (A = Q, B = K in S = Q K^T)
- MN-major, 128B swizzle: ((T,8,m),(8,k)) : ((1,T,LBO),(8T,SBO))  (B = V in O = P V)

then the address swizzle Swizzle<3,4,3> (byte-address bits 4-6 ^= bits 7-9). Every k-step
must decode to the slice of the tile the kernel means. The register side: CUTLASS's
accumulator layout CLayout_64xN and 16-bit A layout ALayout_64x16 against the kernel's row /
key formulas and its P packing. The constants modelled are asserted to be in the kernel
source, so a kernel change the model does not know fails here.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from llmc.cuda.kernels import KernelConfig, source
from llmc.cuda.prefill_sm90_ops import KEYS_PER_TILE, ROWS_PER_CTA, smem_bytes, stages

SRC = source("prefill_sm90", KernelConfig("bfloat16", 128, 32, 8))  # sm90.cuh inlined
BM, BN = ROWS_PER_CTA, KEYS_PER_TILE


def swz(r: int, c: int, rows: int) -> int:
    """Kernel: byte offset of 16-byte chunk c of row r in a [CB][rows][128 B] tile."""
    return (c >> 3) * rows * 128 + r * 128 + (((c & 7) ^ (r & 7)) << 4)


def make_desc(addr: int, lbo: int, sbo: int) -> int:
    """Kernel: the 64-bit wgmma shared-memory descriptor."""
    return ((addr & 0x3FFFF) >> 4) | ((lbo >> 4) << 16) | ((sbo >> 4) << 32) | (1 << 62)


def store(tile: list[list[int]], base: int, smem: dict[int, int]) -> None:
    """Write a [rows][hd] tile of 16-bit values as the kernel does (each 16-byte chunk at
    base + swz); smem maps byte addresses of 16-bit values to values."""
    rows, hd = len(tile), len(tile[0])
    for r, c in itertools.product(range(rows), range(hd // 8)):
        for e in range(8):
            smem[base + swz(r, c, rows) + 2 * e] = tile[r][8 * c + e]


def fields(desc: int) -> tuple[int, int, int]:
    start, lbo, sbo = (
        (desc & 0x3FFF) << 4,
        ((desc >> 16) & 0x3FFF) << 4,
        ((desc >> 32) & 0x3FFF) << 4,
    )
    assert (desc >> 62) == 1, "layout type must be SWIZZLE_128B (1)"
    assert (desc >> 49) & 7 == 0, "base offset 0: every tile is 1024-aligned"
    assert desc & (0x3 << 14) == 0 and desc & (0x3 << 30) == 0, "reserved bits"
    return start, lbo, sbo


def swizzle(addr: int) -> int:
    return addr ^ (((addr >> 7) & 7) << 4)


def decode_kmajor(desc: int, smem: dict[int, int], mn: int) -> list[list[int]]:
    """[mn][16] operand of a K-major SW128 descriptor (LBO unused)."""
    start, _, sbo = fields(desc)
    return [
        [smem[swizzle(start + (i % 8) * 128 + (i // 8) * sbo + 2 * k)] for k in range(16)]
        for i in range(mn)
    ]


def decode_mnmajor(desc: int, smem: dict[int, int], mn: int) -> list[list[int]]:
    """[16][mn] operand (k rows) of an MN-major SW128 descriptor."""
    start, lbo, sbo = fields(desc)
    return [
        [
            smem[swizzle(start + 2 * (j % 64) + (j // 64) * lbo + (k % 8) * 128 + (k // 8) * sbo)]
            for j in range(mn)
        ]
        for k in range(16)
    ]


def tile_values(rows: int, hd: int, tag: int) -> list[list[int]]:
    return [[(tag << 14) | (r * hd + d) & 0x3FFF for d in range(hd)] for r in range(rows)]


def test_kernel_source_has_the_modelled_constants():
    for text in (
        "(c >> 3) * rows * 128 + r * 128 + (((c & 7) ^ (r & 7)) << 4)",
        "(u64)((addr & 0x3FFFF) >> 4) | ((u64)(lbo >> 4) << 16) | ((u64)(sbo >> 4) << 32) |",
        "(1ull << 62)",
        "make_desc(q_wg, 16, 1024), db = make_desc(k_st, 16, 1024)",
        "da + (((kk >> 2) * BM * 128 + (kk & 3) * 32) >> 4)",
        "db + (((kk >> 2) * BN * 128 + (kk & 3) * 32) >> 4)",
        "make_desc(v_st, BN * 128, 1024)",
        "db + ((kk * 16 * 128) >> 4)",
        "q_wg = sQ + cw * 64 * 128",
        ", %64, %65, p, 1, 1, 0, 0; }",  # S = Q K^T: both operands K-major
        ", {%64,%65,%66,%67}, %68, p, 1, 1, 1; }",  # O += P V: V MN-major (trans-b)
        ", {%32,%33,%34,%35}, %36, p, 1, 1, 1; }",
        "cp_async16(dst + swz(key, c, BN), src, bytes)",
        "cp_async16(sQ + swz(r, c, BM), src, R < rows ? 16 : 0)",
        "dst + swz(key, 2 * g, BN)",
        "dst + swz(key, 2 * g + 1, BN)",
        "#define STAGES (HD == 128 ? 2 : 4)",
        "#define SMEM_BYTES (Q_BYTES + 2 * STAGES * TILE_BYTES)",
        f"#define BM {BM} ",
        f"#define BN {BN} ",
    ):
        assert text in SRC, text


@pytest.mark.parametrize("hd", [64, 128])
def test_qk_operands_decode_to_the_tiles(hd):
    """Every k-step of S = Q K^T reads Q rows cw*64.. (A) and all BN keys (B), 16 head dims."""
    smem: dict[int, int] = {}
    s_q, s_k = 0, BM * hd * 2 + 3 * BN * hd * 2  # Q, then (say) the K tile of stage 3
    q, k = tile_values(BM, hd, 1), tile_values(BN, hd, 2)
    store(q, s_q, smem)
    store(k, s_k, smem)
    for cw in range(2):
        q_wg = s_q + cw * 64 * 128
        da, db = make_desc(q_wg, 16, 1024), make_desc(s_k, 16, 1024)
        for kk in range(hd // 16):
            a = decode_kmajor(da + (((kk >> 2) * BM * 128 + (kk & 3) * 32) >> 4), smem, 64)
            b = decode_kmajor(db + (((kk >> 2) * BN * 128 + (kk & 3) * 32) >> 4), smem, BN)
            assert a == [row[16 * kk : 16 * kk + 16] for row in q[64 * cw : 64 * cw + 64]]
            assert b == [row[16 * kk : 16 * kk + 16] for row in k]


@pytest.mark.parametrize("hd", [64, 128])
def test_pv_operand_decodes_to_the_v_tile(hd):
    """Every k-step of O += P V reads 16 keys x all head dims of V (MN-major)."""
    smem: dict[int, int] = {}
    s_v = BM * hd * 2 + (2 * stages(hd) - 1) * BN * hd * 2  # the last V stage
    v = tile_values(BN, hd, 3)
    store(v, s_v, smem)
    db = make_desc(s_v, BN * 128, 1024)
    for kk in range(BN // 16):
        assert decode_mnmajor(db + ((kk * 16 * 128) >> 4), smem, hd) == v[16 * kk : 16 * kk + 16]


def test_tiles_are_1024_aligned_and_fit():
    for hd in (64, 128):
        q_bytes, tile = BM * hd * 2, BN * hd * 2
        assert q_bytes % 1024 == 0 and tile % 1024 == 0 and (64 * 128) % 1024 == 0
        for fp8 in (False, True):  # + the static barriers (1 KB aligned)
            assert smem_bytes(hd, fp8) + 1024 <= 227 * 1024
        assert (hd // 64) * BN * 128 < (1 << 18)  # LBO fits its 14-bit field (>> 4)


def c_layout(t: int, v: int) -> tuple[int, int]:
    """CUTLASS CLayout_64xN (= ALayout_64x16 for 16-bit A): (thread, value) -> (m, n|k)."""
    t0, t1, t2 = t % 4, (t // 4) % 8, t // 32
    v0, v1, v2 = v % 2, (v // 2) % 2, v // 4
    return t1 + 16 * t2 + 8 * v1, 2 * t0 + v0 + 8 * v2


def test_softmax_rows_and_keys_follow_the_accumulator_layout():
    """Kernel: s[4n + c] is row 16 wl + lane/4 + 8 (c >= 2), key 8n + 2 (lane % 4) + (c & 1)
    (the O store uses the same formula with head dims for keys)."""
    for t in range(128):
        lane, wl, tq = t % 32, t // 32, t % 4
        for n, c in itertools.product(range(BN // 8), range(4)):
            row = wl * 16 + (lane >> 2) + (8 if c >= 2 else 0)
            assert c_layout(t, 4 * n + c) == (row, n * 8 + 2 * tq + (c & 1))


def test_p_packing_matches_the_register_a_layout():
    """pack_p: pa[kk][j] = pack2(s[8kk + 2j], s[8kk + 2j + 1]), low half first, so A value
    2j + h of k-step kk is S value 8kk + 2j + h: same row, key 16 kk + its k."""
    for t, kk, v in itertools.product(range(128), range(BN // 16), range(8)):
        m_a, k_a = c_layout(t, v)  # ALayout_64x16 == CLayout_64x16
        assert c_layout(t, 8 * kk + v) == (m_a, 16 * kk + k_a)


@pytest.mark.parametrize("hd", [64, 128])
def test_producer_threads_cover_each_chunk_once(hd):
    ch = hd // 8
    kpp = 128 // ch
    seen = sorted((p // ch + i * kpp, p % ch) for p in range(128) for i in range(BN // kpp))
    assert seen == sorted(itertools.product(range(BN), range(ch)))
    gpr = hd // 16  # fp8: 16-value groups
    kpp = 128 // gpr
    seen = sorted((p // gpr + i * kpp, p % gpr) for p in range(128) for i in range(BN // kpp))
    assert seen == sorted(itertools.product(range(BN), range(gpr)))
    rows = sorted(
        ((p + i * 128) // ch, (p + i * 128) % ch) for p in range(128) for i in range(BM * ch // 128)
    )
    assert rows == sorted(itertools.product(range(BM), range(ch)))


def test_e4m3_to_16_bit_is_exact():
    """Every finite e4m3 value is exact in f16 (the cvt) and in bf16 (f16 -> f32 -> bf16)."""
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    f = codes.float()
    f = f[torch.isfinite(f)]
    assert torch.equal(f.half().float(), f)
    assert torch.equal(f.half().float().bfloat16().float(), f)


def test_register_split_fits_the_pool():
    """setmaxnreg: the producer warpgroup gives back what the two consumers take, with slack
    when ptxas reports fewer than 168 registers at entry (a short pool would make the
    consumers' setmaxnreg.inc wait forever)."""
    import re

    dec = re.search(r'setmaxnreg\.dec\.sync\.aligned\.u32 %0;" ::"n"\(FP8 \? (\d+) : (\d+)\)', SRC)
    inc = re.search(r'setmaxnreg\.inc\.sync\.aligned\.u32 %0;" ::"n"\(FP8 \? (\d+) : (\d+)\)', SRC)
    assert dec and inc
    for producer, consumer in zip(map(int, dec.groups()), map(int, inc.groups()), strict=True):
        assert producer % 8 == 0 and consumer % 8 == 0 and 24 <= producer < consumer <= 256
        for entry in (160, 168):  # 65536 / 384 = 168 at most
            assert 128 * (entry - producer) >= 256 * (consumer - entry), (producer, consumer)


def tile_blocks(bt: list[int], s: int, kt: int, kv_end: int, lane: int) -> int:
    """Kernel (producer v2): lane's block-table entry of the tile at kt."""
    b = (kt >> s) + lane
    return bt[b] if (b << s) < kv_end else 0


def key_slot(ents: list[int], bt: list[int], s: int, key: int, j: int, inside: bool) -> int:
    """Kernel: key_slot<TINY = s < 2>, the shuffle reading lane key >> s of the warp."""
    if s < 2:
        b = bt[j >> s] if inside else 0
    else:
        assert key >> s < 32, "shuffle source lane out of the warp"
        b = ents[key >> s]
    return ((b << s) | (j & ((1 << s) - 1))) if inside else 0


@pytest.mark.parametrize("s", range(9))
def test_shuffled_block_table_gives_every_keys_slot(s):
    """The producer's per-warp table entries + shuffle give the slot of every key below kv_end
    (tokens_per_block 1 .. 256: several tiles per block, several blocks per tile), 0 past it,
    and the lanes read no entry past the blocks the keys use."""
    import random

    for kv_end in (1, 5, 127, 128, 129, 300, 1000):
        nblocks = -(-kv_end // (1 << s))
        bt = random.Random(s * 1000 + kv_end).sample(range(5000), nblocks)
        for kt in range(0, kv_end, BN):
            ents = [tile_blocks(bt + [None] * 64, s, kt, kv_end, lane) for lane in range(32)]
            assert None not in ents, "a lane read past the sequence's blocks"
            for key in range(BN):
                j = kt + key
                want = bt[j >> s] * (1 << s) + j % (1 << s) if j < kv_end else 0
                assert key_slot(ents, bt, s, key, j, j < kv_end) == want, (kt, key)


@pytest.mark.parametrize("hd", [64, 128])
def test_producer_v2_addresses(hd):
    """load_tile_v2: keys p / CH + i * kpp share the swizzle phase of key p / CH, so the
    stage address is one offset per i; copy_raw_fp8 / convert_raw_fp8: thread p's groups at
    (i * 128 + p) * 16 tile the raw fp8 tile once, and the kernel source has these formulas."""
    ch = hd // 8
    kpp = 128 // ch
    for p, i in itertools.product(range(128), range(BN // kpp)):
        c = p % ch
        assert swz(p // ch + i * kpp, c, BN) == swz(p // ch, c, BN) + i * kpp * 128
    gpr = hd // 16
    offs = sorted((i * 128 + p) * 16 for p in range(128) for i in range(BN // (128 // gpr)))
    assert offs == list(range(0, BN * hd, 16))  # RAW_BYTES = BN * HD, 16 bytes per group
    for text in (
        "dst += swz(p / CH, c, BN);",
        "cp_async16(dst + i * kpp * 128, base + (unsigned long long)slot * (NKV * HD),",
        "raw += (unsigned)p * 16u;",
        "cp_async16(raw + i * 128 * 16, base + (unsigned long long)slot * (NKV * HD), in ?",
        ': "r"(raw + (unsigned)(i * 128 + p) * 16u)',
        "b = __shfl_sync(0xffffffffu, ent, key >> bs_shift);",
        "return (b << bs_shift) < kv_end ? bt[b] : 0;",
        "if (bs_shift < 2)",
        "#define RAW_BYTES (BN * HD)",
        "#define SM90_PRODUCER_V2 1",
    ):
        assert text in SRC, text
