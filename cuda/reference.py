"""The torch reference of every kernel op of llmc: the ground truth the CUDA kernels match.

Each function is plain torch, runs on any device, and is written for clarity first. The
``TorchBackend`` (llmc.cuda.torch_backend) calls these; the CuPy kernels in this folder
are tested against them (rel. error < 1e-5 fp32, < 1e-2 bf16/fp16). Conventions (KV layout,
slots, RoPE form, GQA, sampling RNG) are those of ``llmc.cuda.backend``.

Shapes: T = tokens of the step, B = sequences, S = sampled rows, H = hidden, V = vocab,
nq / nkv = query / kv heads, hd = head_dim, I = intermediate size.

Ops:
- ``embedding``          ids [T] → table rows [T, H].
- ``rms_norm``           x * rsqrt(mean(x², -1) + eps) * weight, in float32, cast back.
- ``add_rms_norm``       residual += x (in place, in residual's dtype); rms_norm(residual).
- ``linear``             x @ weight.T (+ bias).
- ``rope_and_cache_write`` NeoX RoPE of q and k (float32 math), k/v written to their slots.
- ``paged_attention``    causal GQA attention over the paged cache, float32 softmax.
- ``silu_and_mul``       silu(gate) * up.
- ``norm_linear`` / ``norm_gate_up_silu`` / ``linear_residual_add``: the small-batch decode
  fusions (cuda/gemv.cu), composed from the ops above, so by construction what the unfused
  sequence computes (every intermediate rounded to the dtype).
- ``philox_uniform``     Philox4x32-10 counter-based uniforms (bit-exact recipe below).
- ``apply_penalties`` / ``apply_filters`` / ``sample``: the sampling pipeline.
"""

from __future__ import annotations

import math

import torch

from llmc.cuda.backend import AttentionMetadata, SamplingMetadata
from llmc.cuda.reference_wo import PackedWeight, embedding_wo, linear_wo

# ---------------------------------------------------------------------------------------
# Dense ops
# ---------------------------------------------------------------------------------------


def embedding(ids: torch.Tensor, table: torch.Tensor | PackedWeight) -> torch.Tensor:
    """ids [T] int64, table [V, H] → table[ids] [T, H] (a ``PackedWeight`` table: its rows
    dequantized, ``llmc.cuda.reference_wo``)."""
    if isinstance(table, PackedWeight):
        return embedding_wo(ids, table)
    return table.index_select(0, ids)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, H] → x * rsqrt(mean(x², -1) + eps) * weight.

    Computed in float32 (as HF's LlamaRMSNorm does for the normalisation) and returned in
    x.dtype. In float32 this is bit-identical to ``LlamaRMSNorm``.
    """
    xf = x.float()
    var = xf.pow(2).mean(-1, keepdim=True)
    return (xf * torch.rsqrt(var + eps) * weight.float()).to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """residual += x (in place, in residual's dtype); returns (rms_norm(residual), residual)."""
    residual.add_(x)
    return rms_norm(residual, weight, eps), residual


def linear(
    x: torch.Tensor, weight: torch.Tensor | PackedWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [T, in], weight [out, in] (nn.Linear layout) → x @ weight.T (+ bias) [T, out].

    A weight-only ``PackedWeight`` computes in float32 (``llmc.cuda.reference_wo``); the
    fused small-step ops below compose ``linear``, so they take one too."""
    if isinstance(weight, PackedWeight):
        return linear_wo(x, weight, bias)
    return torch.nn.functional.linear(x, weight, bias)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] = gate | up → silu(gate) * up [T, I] (in x.dtype)."""
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def norm_linear(
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor | PackedWeight,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """linear(rms_norm(residual), weight, bias): residual [T, K] → [T, N] (the qkv path)."""
    return linear(rms_norm(residual, norm_weight, eps), weight, bias)


def norm_gate_up_silu(
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    gate_up_weight: torch.Tensor | PackedWeight,
) -> torch.Tensor:
    """silu_and_mul(linear(rms_norm(residual), gate_up_weight)): [T, K] → [T, I].

    gate_up_weight [2I, K] holds the gate rows, then the up rows.
    """
    return silu_and_mul(linear(rms_norm(residual, norm_weight, eps), gate_up_weight))


def linear_residual_add(
    x: torch.Tensor, weight: torch.Tensor | PackedWeight, residual: torch.Tensor
) -> torch.Tensor:
    """residual += linear(x, weight) (in place, in residual's dtype); returns residual."""
    return residual.add_(linear(x, weight))


# ---------------------------------------------------------------------------------------
# RoPE + KV-cache write
# ---------------------------------------------------------------------------------------


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, hd]; cos/sin [T, hd // 2] float32 → x*cos + rotate_half(x)*sin in float32.

    The half tables are duplicated to full head_dim ([c, c]) as HF's ``cat((freqs, freqs))``.
    """
    c = torch.cat((cos, cos), dim=-1)[:, None, :]
    s = torch.cat((sin, sin), dim=-1)[:, None, :]
    xf = x.float()
    return xf * c + _rotate_half(xf) * s


def rope_and_cache_write(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    k_mean: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rotate q and k, write k and v to the paged cache; return rotated q.

    qkv [T, (nq + 2 nkv) hd] with columns q | k | v; positions [T] int64 index the tables
    cos/sin [max_position, hd // 2] float32; k_cache/v_cache [num_blocks, tokens_per_block,
    nkv, hd]; slot_mapping [T] int64, slot = block * tokens_per_block + offset, -1 = do not
    write. Returns q [T, nq, hd] in qkv.dtype. Rotation math is float32, cast once.
    An e4m3 cache (``llmc.cuda.reference_fp8``) stores ``sat(k * float32(1 / k_scale))``
    (v likewise) from the float32 rotated k and the v values; other caches ignore the scales.
    ``k_mean`` [nkv, hd] float32 (an e4m3 cache only; smooth K, as SageAttention): the cache
    stores ``sat((k - k_mean) * float32(1 / k_scale))``, float32 math. Attention is unchanged
    by it: q.(k - m) = q.k - q.m shifts every key's score of one query by the same amount,
    which softmax cancels; what it buys is that the cached values are centred, so e4m3's
    relative rounding is of the small part of k that varies from token to token.
    """
    nkv, hd = k_cache.shape[2], k_cache.shape[3]
    t = qkv.shape[0]
    nq = qkv.shape[1] // hd - 2 * nkv
    q = qkv[:, : nq * hd].view(t, nq, hd)
    k = qkv[:, nq * hd : (nq + nkv) * hd].view(t, nkv, hd)
    v = qkv[:, (nq + nkv) * hd :].view(t, nkv, hd)
    c, s = cos.index_select(0, positions), sin.index_select(0, positions)
    q_rot = apply_rope(q, c, s).to(qkv.dtype)
    k_rot = apply_rope(k, c, s)
    if k_mean is not None and k_cache.dtype == torch.float8_e4m3fn:
        k_rot = k_rot - k_mean.float()
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k_cache.view(-1, nkv, hd)[slots] = to_cache(k_rot[keep], k_cache.dtype, k_scale)
    v_cache.view(-1, nkv, hd)[slots] = to_cache(v[keep], v_cache.dtype, v_scale)
    return q_rot


def to_cache(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """Values as a cache of ``dtype`` stores them: e4m3 ``sat(x * float32(1 / scale))``
    (float32 math, round to nearest even), else a plain cast."""
    if dtype != torch.float8_e4m3fn:
        return x.to(dtype)
    inv = torch.tensor(1.0 / scale, dtype=torch.float32)
    return (x.float() * inv).clamp(-448.0, 448.0).to(dtype)


def from_cache(x: torch.Tensor, scale: float) -> torch.Tensor:
    """Cached values in float32: e4m3 codes times their scale, others as they are."""
    if x.dtype != torch.float8_e4m3fn:
        return x.float()
    return x.float() * torch.tensor(scale, dtype=torch.float32)


# ---------------------------------------------------------------------------------------
# Paged attention
# ---------------------------------------------------------------------------------------


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` tokens of one sequence from a paged cache → [length, nkv, hd]."""
    tpb = cache.shape[1]
    nblocks = (length + tpb - 1) // tpb
    blocks = block_table[:nblocks].long()
    return cache.index_select(0, blocks).flatten(0, 1)[:length]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Batched GQA attention in float32.

    q [N, n, nq, hd], k/v [N, L, nkv, hd], mask [N, n, L] bool (True = attend)
    → [N, n, nq, hd] float32. Query head h reads kv head h // (nq // nkv).
    """
    nb, n, nq, hd = q.shape
    nkv = k.shape[2]
    g = nq // nkv
    qf = q.float().view(nb, n, nkv, g, hd).permute(0, 2, 3, 1, 4)  # [N, nkv, g, n, hd]
    kf = k.float().permute(0, 2, 3, 1)[:, :, None]  # [N, nkv, 1, hd, L]
    vf = v.float().permute(0, 2, 1, 3)[:, :, None]  # [N, nkv, 1, L, hd]
    scores = torch.matmul(qf, kf) * (1.0 / math.sqrt(hd))  # [N, nkv, g, n, L]
    scores = scores.masked_fill(~mask[:, None, None], float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), vf)  # [N, nkv, g, n, hd]
    return out.permute(0, 3, 1, 2, 4).reshape(nb, n, nq, hd)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Causal varlen GQA attention over each sequence's paged cache.

    q [T, nq, hd] (rotated). Sequence b owns query rows cu_seqlens_q[b]:cu_seqlens_q[b+1]
    (q_len_b rows) and a context of seq_lens[b] tokens (cached + this step's, already written
    to the cache) reached through block_tables[b]. Query row i of sequence b sits at position
    ``seq_lens[b] - q_len_b + i`` and attends to keys at positions 0..that position. Scale
    1/sqrt(hd); softmax in float32; returns [T, nq * hd] in q.dtype. Rows of no sequence
    (beyond cu_seqlens_q[B]) are zero.

    An e4m3 cache is read as codes times ``k_scale`` / ``v_scale`` (``from_cache``).

    The first ``num_decode_seqs`` sequences (one query each) are computed as one padded
    batch; each other sequence on its own. Reads the lengths to the host (a sync on CUDA:
    acceptable for the reference).
    """
    t, nq, hd = q.shape
    out = torch.zeros(t, nq, hd, dtype=torch.float32, device=q.device)
    cu = meta.cu_seqlens_q.tolist()
    lens = meta.seq_lens.tolist()
    d = meta.num_decode_seqs
    if d:
        tpb = k_cache.shape[1]
        nblocks = -(-max(lens[:d]) // tpb)
        blocks = meta.block_tables[:d, :nblocks].long().clamp(min=0)  # -1 pads read block 0
        k = from_cache(k_cache[blocks].flatten(1, 2), k_scale)  # [d, nblocks * tpb, nkv, hd]
        v = from_cache(v_cache[blocks].flatten(1, 2), v_scale)
        pos = torch.arange(k.shape[1], device=q.device)
        mask = (pos[None, :] < meta.seq_lens[:d, None].long())[:, None, :]  # [d, 1, L]
        out[cu[0] : cu[d]] = _attend(q[cu[0] : cu[d]].view(d, 1, nq, hd), k, v, mask)[:, 0]
    for b in range(d, len(lens)):
        lo, hi, ctx = cu[b], cu[b + 1], lens[b]
        if hi == lo:
            continue
        k = from_cache(gather_kv(k_cache, meta.block_tables[b], ctx), k_scale)
        v = from_cache(gather_kv(v_cache, meta.block_tables[b], ctx), v_scale)
        qpos = torch.arange(ctx - (hi - lo), ctx, device=q.device)
        mask = torch.arange(ctx, device=q.device)[None, :] <= qpos[:, None]
        out[lo:hi] = _attend(q[None, lo:hi], k[None], v[None], mask[None])[0]
    return out.view(t, nq * hd).to(q.dtype)


# ---------------------------------------------------------------------------------------
# Sampling: RNG
# ---------------------------------------------------------------------------------------

M32 = 0xFFFFFFFF
PHILOX_M0, PHILOX_M1 = 0xD2511F53, 0xCD9E8D57
PHILOX_W0, PHILOX_W1 = 0x9E3779B9, 0xBB67AE85


def _mulhilo32(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) 32-bit words of the 64-bit product a * b, a a uint32 constant, b uint32 in int64.

    The product can exceed int64, so the constant is split in 16-bit halves: every partial
    product stays below 2**49. (CUDA: ``__umulhi(a, b)`` and ``a * b``.)
    """
    p0 = b * (a & 0xFFFF)  # < 2**48
    p1 = b * (a >> 16)  # < 2**48; a*b = p0 + p1 * 2**16
    t = p0 + ((p1 & 0xFFFF) << 16)
    lo = t & M32
    hi = ((p1 >> 16) + (t >> 32)) & M32
    return hi, lo


def philox4x32_10(
    ctr: tuple[torch.Tensor, ...], key: tuple[torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, ...]:
    """Philox4x32-10 (Salmon et al. 2011, Random123) on uint32 words held in int64 tensors.

    One round: (hi0, lo0) = mulhilo(M0, c0); (hi1, lo1) = mulhilo(M1, c2);
    c = (hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0); then the key is bumped
    (k0 += W0, k1 += W1 mod 2**32) before each of the rounds 2..10.
    Checked against the Random123 known-answer vectors in tests.
    """
    c0, c1, c2, c3 = ctr
    k0, k1 = key
    for r in range(10):
        if r:
            k0 = (k0 + PHILOX_W0) & M32
            k1 = (k1 + PHILOX_W1) & M32
        hi0, lo0 = _mulhilo32(PHILOX_M0, c0)
        hi1, lo1 = _mulhilo32(PHILOX_M1, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


def philox_uniform(seeds: torch.Tensor, offsets: torch.Tensor, vocab: int) -> torch.Tensor:
    """Uniforms u[s, v] in (0, 1), float32, a pure function of (seeds[s], offsets[s], v).

    Exact integer recipe (reproduce bit for bit in CUDA with uint32 arithmetic):
      key     = (seed mod 2**32, (seed >> 32) mod 2**32)      seed as a uint64 (two's complement)
      counter = (v, offset mod 2**32, (offset >> 32) mod 2**32, 0)
      x       = word 0 of philox4x32_10(counter, key)
      u       = float32(2 * (x >> 9) + 1) * 2**-24            exact; in [2**-24, 1 - 2**-24]
    seeds, offsets: [S] int64 → [S, V] float32.
    """
    dev = seeds.device
    s = seeds.long()[:, None]
    o = offsets.long()[:, None]
    v = torch.arange(vocab, dtype=torch.int64, device=dev)[None, :]
    zeros = torch.zeros_like(v)
    ctr = (v, o & M32, (o >> 32) & M32, zeros)
    key = (s & M32, (s >> 32) & M32)
    x = philox4x32_10(ctr, key)[0]
    return (2 * (x >> 9) + 1).to(torch.float32) * (2.0**-24)


# ---------------------------------------------------------------------------------------
# Sampling: logits processing and selection
# ---------------------------------------------------------------------------------------


def apply_penalties(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Penalised copy of logits [S, V] float32 (unchanged rows where penalties are neutral).

    1. repetition (HF ``RepetitionPenaltyLogitsProcessor`` / CTRL): for every token seen in
       prompt or output, logit / r if logit > 0 else logit * r;
    2. frequency and presence (OpenAI): logit -= f * count_out + p * (count_out > 0), on
       the output tokens only.
    ``meta.output_counts`` [S, V] int and ``meta.prompt_mask`` [S, V] bool must be present
    when any row's penalty is not neutral.
    """
    if meta.output_counts is None:
        return logits
    counts = meta.output_counts.to(torch.float32)
    seen = meta.prompt_mask | (meta.output_counts > 0)
    r = meta.repetition_penalty[:, None]
    penalised = torch.where(logits > 0, logits / r, logits * r)
    out = torch.where(seen, penalised, logits)
    out = out - meta.frequency_penalty[:, None] * counts
    return out - meta.presence_penalty[:, None] * (counts > 0).to(torch.float32)


MASS_SCALE = 2.0**32
"""Top-p masses are integers: q_v = floor(exp(l_v - max) * 2**32) (<= 2**32, so a row's sum
stays far below 2**53): sums of integers are exact in any order, which is what lets the
multi-CTA kernel and this reference agree on the kept set bit for bit."""


def apply_filters(scaled: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Temperature-scaled logits [S, V] → the same with filtered-out entries at -inf.

    Applied in HF's order, each on the distribution left by the previous one. With
    M = the row max and e_v = exp(l_v - M) (float32, as CUDA's ``expf``):
    - top-k (k > 0): keep l >= the k-th largest value (ties at the threshold kept);
    - top-p (p < 1), on the top-k-kept set K: masses q_v = floor(e_v * 2**32) as integers,
      Z = sum over K of q; keep v iff A_v = sum of q_w over w in K with l_w > l_v
      satisfies float64(A_v) < float64(p) * float64(Z) (the smallest top set with mass
      >= p, all tied tokens included; p <= 0 keeps the max and its ties);
    - min-p (m > 0): keep e_v >= m (= prob >= m * max prob, HF ``MinPLogitsWarper``).
    The most likely token always survives. Rows whose max is not finite (all -inf, or a
    +inf) are returned unfiltered: ``sample`` then takes their first maximum.
    Values compare as floats (-0 == +0); NaN logits are not supported.
    """
    s, vocab = scaled.shape
    ninf = torch.tensor(float("-inf"), device=scaled.device)
    sorted_vals = scaled.sort(dim=-1, descending=True).values
    row_max = sorted_vals[:, :1]
    finite = torch.isfinite(row_max)
    k = meta.top_k.long().clamp(min=0)
    k_eff = torch.where(k > 0, k.clamp(max=vocab), torch.full_like(k, vocab))
    kth = sorted_vals.gather(1, (k_eff - 1)[:, None])
    in_k = sorted_vals >= kth  # a prefix of the sorted row
    # top-p on the top-k-kept set, in exact integer masses
    e = torch.exp(sorted_vals - row_max)
    q = torch.where(in_k, (e * MASS_SCALE).floor().to(torch.int64), 0)
    z = q.sum(dim=-1, keepdim=True)
    # mass strictly above each value: the exclusive cumsum at the first of its ties
    pos = torch.arange(vocab, device=scaled.device).expand(s, vocab)
    run_start = torch.ones_like(in_k)
    run_start[:, 1:] = sorted_vals[:, 1:] != sorted_vals[:, :-1]
    first = torch.where(run_start, pos, 0).cummax(dim=-1).values
    above = (q.cumsum(dim=-1) - q).gather(1, first)
    p = meta.top_p.double()[:, None]
    keep = in_k & ((above.double() < p * z.double()) | (p >= 1.0))
    keep[:, 0] = True
    threshold = sorted_vals.gather(1, keep.sum(dim=-1, keepdim=True) - 1)
    out = torch.where(scaled < threshold, ninf, scaled)
    min_keep = torch.exp(out - row_max) >= meta.min_p[:, None]
    out = torch.where(min_keep, out, ninf)
    return torch.where(finite, out, scaled)


def process_logits(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """logits [S, V] → the logits each row samples from (float32).

    Greedy rows (temperature 0): penalised logits. Sampled rows: penalised logits / T with
    top-k, top-p and min-p filtering (filtered entries -inf).
    """
    pen = apply_penalties(logits.float(), meta)
    if meta.all_greedy:
        return pen
    greedy = meta.temperature <= 0
    t = torch.where(greedy, torch.ones_like(meta.temperature), meta.temperature)
    filtered = apply_filters(pen / t[:, None], meta)
    return torch.where(greedy[:, None], pen, filtered)


def sample(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """logits [S, V] → token ids [S] int64.

    Greedy rows: argmax of the penalised logits (first index on ties). Sampled rows: the
    Gumbel-max trick ``argmax(l_v - log(-log u_v))`` over the processed logits l (which
    equals argmax(log p_v - log(-log u_v)): softmax normalisation is a per-row constant),
    with u = philox_uniform(seed, offset); an exact sample of softmax(l), independent of
    the batch (first index on equal keys; a row whose max is not finite takes its first
    maximum). Every step is an elementwise float32 op the kernel repeats (division, exp,
    log: torch's CUDA exp / log are CUDA's expf / logf), a max, or integer arithmetic
    (``apply_filters``' masses), never an order-dependent float sum: on the GPU, the CUDA
    kernel picks the same token bit for bit.
    """
    proc = process_logits(logits, meta)
    if meta.all_greedy:
        return proc.argmax(dim=-1)
    u = philox_uniform(meta.seeds, meta.offsets, proc.shape[1])
    keys = proc - torch.log(-torch.log(u))
    greedy = meta.temperature <= 0
    return torch.where(greedy, proc.argmax(dim=-1), keys.argmax(dim=-1))
