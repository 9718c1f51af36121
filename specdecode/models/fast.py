"""The CPU fast path: pre-packed weights and the whole layer loop in one C++ call.

`accelerate(model)` transforms a loaded `LlamaModel` after construction (the model code itself
does not branch on it): every projection is packed for the small-M kernels of `kernels.py`
(fp32 or bf16 storage, as the model was loaded, or int8 / int4: a drafter's `draft_dtype`, a
target's `quantization`), the unpacked
copies are freed, and `model.fast` is set, which `LlamaModel.forward` / `compute_logits` hand
over to. Activations, norms and the KV cache are fp32 on this path, whatever the weight dtype:
bf16 (int8, int4) only halves (quarters, eighths) the bytes streamed per step; with bf16
weights on a CPU with AVX512_BF16 the projections' inputs are rounded to bf16 for vdpbf16ps
(int8 / int4 on AVX512_VNNI: to int8 per row, for vpdpbusd). The projections compute each
output row in an order independent of the batch (so bf16 weights do not flip near-ties
between decoding and verification through them); attention still sums in a shape-dependent
order.
"""

from __future__ import annotations

import logging

import torch

from specdecode import kernels
from specdecode.models.attention import AttentionMetadata

log = logging.getLogger(__name__)

_EMPTY = torch.empty(0)


class FastPath:
    def __init__(self, model, weight_dtype: torch.dtype) -> None:
        self.ext = kernels.load_extension()
        cfg = model.config
        self.dims = layer_dims(cfg)
        self.eps = cfg.rms_norm_eps
        # bf16 weights on a CPU with vdpbf16ps: round the projections' inputs to bf16 (as a
        # bf16 model does anyway) and multiply pairs natively, ~2x less compute per row
        self.bf16_activations = weight_dtype == torch.bfloat16 and kernels.cpu_has_bf16_dot()
        self.weights: list[torch.Tensor] = []
        self._keep: list[kernels.PackedLinear] = []
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            packs = [attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj]
            self.weights += layer_weights(layer, *(self._pack(p, weight_dtype) for p in packs))
        self.weights.append(_f32(model.norm.weight))
        self.lm_head = kernels.pack(
            model.lm_head.weight.detach(),
            dtype=weight_dtype,
            bf16_activations=self.bf16_activations,
        )
        self.cos, self.sin = (t.contiguous() for t in model.rope_tables(torch.float32))

    def _pack(self, linear: torch.nn.Linear, dtype: torch.dtype) -> kernels.PackedLinear:
        bias = linear.bias.detach().float() if linear.bias is not None else None
        packed = kernels.pack(linear.weight.detach(), bias, dtype=dtype)
        self._keep.append(packed)
        linear.weight = torch.nn.Parameter(_EMPTY, requires_grad=False)  # free the original
        return packed

    def forward(
        self, model, input_ids, positions, meta: AttentionMetadata, capture_layers: tuple[int, ...]
    ):
        from specdecode.models.llama import ModelOutput

        h = model.embed_tokens(input_ids).float()
        cos, sin = self.cos[positions], self.sin[positions]
        out = layer_loop(
            self.ext, h, cos, sin, meta, self.weights, self.dims, self.eps,
            self.bf16_activations, list(capture_layers),
        )  # fmt: skip
        return ModelOutput(out[0], list(out[1:]))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return kernels.linear(hidden.float(), self.lm_head)


def layer_dims(cfg) -> list[int]:
    """A layer's sizes as the C++ loop reads them (`Dims` in decoder.cpp)."""
    return [cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size]


def layer_weights(layer, qkv, o, gate_up, down, input_norm: bool = True) -> list[torch.Tensor]:
    """One decoder layer's entries in the C++ loop's order (kPerLayer in decoder.cpp), its
    projections packed (`kernels.PackedLinear`); without `input_norm` the layer's attention
    input is given to the loop (an EAGLE head's)."""
    attn = layer.self_attn
    return [
        _f32(layer.input_layernorm.weight) if input_norm else _EMPTY,
        qkv.weight,
        qkv.bias if qkv.bias is not None else _EMPTY,
        o.weight,
        _f32(layer.post_attention_layernorm.weight),
        gate_up.weight,
        down.weight,
        _f32(attn.q_norm.weight) if attn.q_norm is not None else _EMPTY,
        _f32(attn.k_norm.weight) if attn.k_norm is not None else _EMPTY,
    ]


def layer_loop(
    ext, h, cos, sin, meta: AttentionMetadata, weights, dims, eps, bf16_activations,
    capture: list[int], attn_in: torch.Tensor = _EMPTY,
) -> list[torch.Tensor]:  # fmt: skip
    """One call of the C++ layer loop (`decoder.cpp`'s forward_layers) over the attention
    layout of `meta`: [final hidden, captured residual streams...]."""
    if meta.kv_range is not None:
        start, end = meta.kv_range
        slots = index = valid = _EMPTY
    else:
        start = end = -1
        slots, index, valid = meta.kv_slots, meta.query_index, meta.query_valid
    mask = meta.mask if meta.mask is not None else _EMPTY
    return ext.forward_layers(
        h, cos, sin, meta.kv_cache, meta.slot_mapping, start, end, slots, index, valid, mask,
        weights, dims, eps, bf16_activations, capture, attn_in,
    )  # fmt: skip


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t.detach().float().contiguous()


def can_accelerate(model) -> bool:
    device = model.norm.weight.device
    dtype = model.norm.weight.dtype
    return (
        device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and (kernels.available())
    )


def accelerate(model, weight_dtype: torch.dtype | None = None) -> bool:
    """Switch `model` to the fast path if this machine supports it; True if it did.
    `weight_dtype` (default: the model's) is how the projections are stored: fp32, bf16, or
    int8 / int4 (a drafter's draft_dtype, a target's quantization; see kernels.pack)."""
    if model.fast is not None:
        return True
    if not can_accelerate(model):
        log.info("CPU kernels unavailable: using the eager PyTorch path")
        return False
    if weight_dtype == torch.int4 and not kernels.int4_ready():
        # unpacked int4 weights would reach the layer loop, which reads packed ones only
        log.info("int4 weights need AVX512_VNNI here: using the eager PyTorch path")
        return False
    model.fast = FastPath(model, weight_dtype or model.norm.weight.dtype)
    return True
