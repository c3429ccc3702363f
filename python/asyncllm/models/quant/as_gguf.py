"""Int8 and int4 checkpoint weights as GGUF blocks, so that they run the GGUF
layers' kernels: the integer dot-product kernel at decode, the measured choice of
kernel per row bucket, and the fused decode step (`models.fused_decode`).

A `QuantLinear` keeps `w = (q - zero) * scale` per group of inputs; GGUF's blocks
keep 32 inputs each with an f16 scale, so a group of a multiple of 32 inputs is
that many blocks sharing its scale:

    int8, symmetric        Q8_0: d = scale, the int8 q as they are (W8A8 too)
    int4, symmetric        Q4_0: d = scale, nibble u = q + 8 (w = d * (u - 8))
    int4, zero points      Q4_1: d = scale, m = -scale * (8 + zero) (w = d * u + m)

The integers are copied bit for bit. Scales stored in f16, or in bf16 within f16's
range, are f16 values already, and `--quantization` rounds its own up to f16, so
their weights are exact; float32 scales are rounded to f16 (a weight moves by at
most 2^-10 of itself, far inside its int4 or int8 rounding), and Q4_1's offset m
too (~1 % of a quantization step at most). Layers that do not fit stay
`QuantLinear` (the checked reference of these kernels, and every layer's with
ASYNCLLM_QUANT_KERNEL=reference): int8 with zero points, groups that are no
multiple of 32, scales beyond f16's range, row-parallel slices.

The kernels differ from the reference as a GGUF model's do from dequantize + fp32:
the integer kernel rounds x to int8 per 16 inputs (`models.gguf.layers`), the tiled
ones keep x in float. For W8A8 layers that replaces vLLM's per-token int8 inputs
(one scale a row: `QuantLinear`'s arithmetic) by finer ones, so their results lie
closer to the float weights' than vLLM's do; the reference keeps vLLM's.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from asyncllm.models.gguf.layers import GGUFLinear
from asyncllm.models.quant.layers import QuantLinear, unpack_int4

logger = logging.getLogger(__name__)

BLOCK = 32  # inputs a GGUF block holds
# The most a scale may move, relatively, as the f16 of its block: f16's rounding in
# its normal range is half of this; near the bottom of that range fewer bits remain.
F16_ROUNDING = 2.0**-10


def why_not(layer: QuantLinear) -> str | None:
    """Why `layer`'s weight has no exact GGUF form, or None when it has one."""
    if type(layer) is not QuantLinear:
        return f"a {type(layer).__name__} (a row-parallel slice)"
    if layer.bits == 8 and layer.zeros is not None:
        return "int8 with zero points"
    if layer.group_size % BLOCK:
        return f"groups of {layer.group_size} inputs, no multiple of {BLOCK}"
    scales = layer.scales
    off = (scales.half().float() - scales).abs()
    if not (torch.isfinite(scales).all() and (off <= scales.abs() * F16_ROUNDING).all()):
        return "scales out of f16's range"
    return None


def gguf_blocks(layer: QuantLinear) -> tuple[str, torch.Tensor]:
    """(block type, uint8 [out, blocks * bytes]) holding `layer`'s weight (the
    caller checked `why_not`)."""
    out, n_in = layer.out_features, layer.in_features
    nb = n_in // BLOCK
    # each block's scale: its group's
    d = layer.scales.repeat_interleave(layer.group_size // BLOCK, dim=1).half()
    if layer.bits == 8:
        body = layer.qweight.view(torch.uint8).view(out, nb, BLOCK)
        return "Q8_0", _blocks([d], body)
    u = (unpack_int4(layer.qweight).to(torch.int16) + 8).to(torch.uint8).view(out, nb, BLOCK)
    body = u[:, :, :16] | (u[:, :, 16:] << 4)  # input j low, j + 16 high
    if layer.zeros is None:
        return "Q4_0", _blocks([d], body)
    zeros = layer.zeros.float().repeat_interleave(layer.group_size // BLOCK, dim=1)
    m = (-d.float() * (8.0 + zeros)).half()
    return "Q4_1", _blocks([d, m], body)


def _blocks(halves: list[torch.Tensor], body: torch.Tensor) -> torch.Tensor:
    """Blocks of the f16 fields `halves` ([out, blocks] each) then `body`."""
    out, nb, _ = body.shape
    fields = [h.contiguous().view(torch.uint8).view(out, nb, 2) for h in halves]
    return torch.cat([*fields, body], dim=2).reshape(out, -1).contiguous()


def as_gguf_linears(model: nn.Module) -> int:
    """Swap every `QuantLinear` of `model` whose weight has an exact GGUF form for
    a `GGUFLinear` over those blocks (in the panel layout, on the CPU), keeping
    its bias; returns how many. The LM head follows (`logits_head`)."""
    swapped, kept = 0, set()
    for path, module in list(model.named_modules()):
        if not isinstance(module, QuantLinear):
            continue
        reason = why_not(module)
        if reason is not None:
            kept.add(reason)
            continue
        qtype, raw = gguf_blocks(module)
        bias = None if module.bias is None else module.bias.detach()
        layer = GGUFLinear([(qtype, raw)], module.in_features, bias)
        layer.pack_panels()
        model.set_submodule(path, layer)
        if getattr(model, "logits_head", None) is module:
            layer.out_dtype = torch.float32  # as a GGUF model's head: the logits as computed
            model.logits_head = layer
        swapped += 1
    if kept:
        logger.info("quantized layers left on the reference path: %s", "; ".join(sorted(kept)))
    return swapped
