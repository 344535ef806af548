"""Pre-quantized FP8 HF checkpoints written by hand from a tiny float checkpoint, in the
layouts ``llmc.compiler.fp8_checkpoint`` reads:

- ``fp8-tensor``: ``quant_method: fp8`` (AutoFP8 / NeuralMagic): a scalar ``weight_scale`` []
  and a static ``input_scale`` [] per projection;
- ``ct-tensor``: compressed-tensors float-quantized, per-tensor ``weight_scale`` [1] and static
  ``input_scale`` [1];
- ``ct-channel``: compressed-tensors FP8-dynamic, ``weight_scale`` [out, 1] in bfloat16, no
  input scales.

Every layout ignores lm_head (left in the checkpoint's dtype) and, with ``kv``, adds
``self_attn.k_scale`` / ``v_scale`` scalars per layer. ``write_fp8_checkpoint`` returns the
directory; ``edit`` changes the tensor dict (a broken scale, a NaN) before it is saved.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

LAYOUTS = ("fp8-tensor", "ct-tensor", "ct-channel")
PROJECTIONS = (
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
)  # fmt: skip


def projection_names(num_layers: int) -> list[str]:
    """HF names of the quantized weights."""
    return [f"model.layers.{n}.{p}.weight" for n in range(num_layers) for p in PROJECTIONS]


def kv_scale_values(layer: int) -> tuple[float, float]:
    """The (k_scale, v_scale) the helper writes for ``layer``."""
    return 0.0625 * (layer + 1), 0.03125


def _quantize(w: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    wf = w.float()
    if layout == "ct-channel":
        scale = (wf.abs().amax(dim=1, keepdim=True) / 448.0).to(torch.bfloat16)  # [out, 1]
    else:
        scale = (wf.abs().amax() / 448.0).reshape(() if layout == "fp8-tensor" else (1,))
    codes = (wf / scale.float()).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return codes, scale


def config_for(layout: str, kv: bool) -> dict:
    """The ``quantization_config`` of a layout."""
    if layout == "fp8-tensor":
        return {"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": ["lm_head"]}
    channel = layout == "ct-channel"
    arg = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False}
    acts = {**arg, "strategy": "tensor"}
    if channel:  # FP8-dynamic: per-token activation scales computed at run time
        acts = {**arg, "strategy": "token", "dynamic": True}
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "ignore": ["lm_head"],
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {**arg, "strategy": "channel" if channel else "tensor"},
                "input_activations": acts,
            }
        },
        "kv_cache_scheme": {**arg, "strategy": "tensor"} if kv else None,
    }


def quantized_tensors(
    tensors: dict[str, torch.Tensor], layout: str, num_layers: int, kv: bool = True
) -> dict[str, torch.Tensor]:
    """``tensors`` (HF names, float) with every projection in e4m3 plus its scales."""
    out = dict(tensors)
    for name in projection_names(num_layers):
        base = name.removesuffix("weight")
        out[name], out[base + "weight_scale"] = _quantize(tensors[name], layout)
        if layout != "ct-channel":
            shape = () if layout == "fp8-tensor" else (1,)
            out[base + "input_scale"] = torch.full(shape, 0.02, dtype=torch.float32)
    if kv:
        for n in range(num_layers):
            k, v = kv_scale_values(n)
            out[f"model.layers.{n}.self_attn.k_scale"] = torch.tensor(k, dtype=torch.float32)
            out[f"model.layers.{n}.self_attn.v_scale"] = torch.tensor(v, dtype=torch.float32)
    return out


def write_fp8_checkpoint(
    src: Path,
    dst: Path,
    layout: str,
    *,
    kv: bool = True,
    edit: Callable[[dict[str, torch.Tensor]], None] | None = None,
    config: dict | None = None,
) -> Path:
    """A copy of the float checkpoint ``src`` at ``dst``, pre-quantized in ``layout``.
    ``config``: a quantization_config to write instead of the layout's."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    tensors = load_file(str(dst / "model.safetensors"))
    q = quantized_tensors(tensors, layout, cfg["num_hidden_layers"], kv)
    if edit is not None:
        edit(q)
    save_file({k: v.contiguous() for k, v in q.items()}, str(dst / "model.safetensors"))
    cfg["quantization_config"] = config_for(layout, kv) if config is None else config
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst
