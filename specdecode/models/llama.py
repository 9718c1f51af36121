"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2/2.5, Qwen3, SmolLM).

Written for the engine, not for training: q/k/v and gate/up are fused into one linear each, the
KV cache is the engine's (see `attention.py`), positions are explicit (so a token tree is just a
list of positions plus a mask), and the LM head is applied separately, only where logits are needed.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from specdecode.config import ModelConfig, RopeConfig
from specdecode.models.attention import AttentionMetadata, paged_attention


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight.to(x.dtype), self.eps)


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:  # [head_dim // 2]
    inv = 1.0 / rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    if rope.scaling is None:
        return inv
    if rope.scaling[0] == "linear":
        return inv / rope.scaling[1]
    # Llama 3.1 frequency-dependent scaling (Meta's reference; same as transformers' "llama3").
    _, factor, low, high, original = rope.scaling
    wavelen = 2 * math.pi / inv
    low_wl, high_wl = original / low, original / high
    smooth = (original / wavelen - low) / (high - low)
    mid = (1 - smooth) * inv / factor + smooth * inv
    return torch.where(wavelen > low_wl, inv / factor, torch.where(wavelen < high_wl, inv, mid))


def rope_table(cfg: ModelConfig, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [max_pos, head_dim], computed in float64 and cast once to `dtype`."""
    inv = rope_inv_freq(cfg.rope, cfg.head_dim)
    t = torch.arange(cfg.max_position_embeddings, dtype=torch.float64)
    emb = torch.cat([torch.outer(t, inv)] * 2, dim=-1)
    return emb.cos().to(device=device, dtype=dtype), emb.sin().to(device=device, dtype=dtype)


def unfuse(name: str, t: torch.Tensor, cfg: ModelConfig) -> list[tuple[str, torch.Tensor]]:
    """A fused qkv_proj / gate_up_proj tensor as the Hugging Face q/k/v or gate/up tensors
    (any other tensor unchanged)."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    if "qkv_proj" in name:
        parts = zip("qkv", ((0, q), (q, q + kv), (q + kv, q + 2 * kv)), strict=True)
        return [(name.replace("qkv_proj", f"{p}_proj"), t[a:b].clone()) for p, (a, b) in parts]
    if "gate_up_proj" in name:
        inter = cfg.intermediate_size
        return [
            (name.replace("gate_up_proj", "gate_proj"), t[:inter].clone()),
            (name.replace("gate_up_proj", "up_proj"), t[inter:].clone()),
        ]
    return [(name, t)]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D]; cos/sin [T, 1, D]. Half-split rotation (the HF checkpoint convention)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        )
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(
            cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias
        )
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        q, k, v = self._project(x, cos, sin)
        return self.o_proj(paged_attention(q, k, v, self.layer, meta))

    def _project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [..., H] -> q [..., heads, D], k and v [..., kv_heads, D], rotary applied."""
        lead = x.shape[:-1]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(*lead, self.num_heads, self.head_dim)
        k = k.view(*lead, self.num_kv_heads, self.head_dim)
        v = v.view(*lead, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def forward_dense(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [B, T, H] with causal attention over the T tokens only (no cache)."""
        b, t, _ = x.shape
        q, k, v = self._project(x, cos, sin)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            is_causal=True,
            enable_gqa=True,
        )
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.inter = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.inter, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, h, cos, sin, meta):
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, meta)
        return h + self.mlp(self.post_attention_layernorm(h))

    def forward_dense(self, h, cos, sin):  # h [B, T, H]
        h = h + self.self_attn.forward_dense(self.input_layernorm(h), cos, sin)
        return h + self.mlp(self.post_attention_layernorm(h))


@dataclass
class ModelOutput:
    hidden: torch.Tensor  # [T, hidden] final feature (after the last norm), input of the LM head
    # each [T, hidden]: the residual stream entering a chosen layer (layer N: leaving the last)
    captured: list[torch.Tensor]


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self._rope_cache: tuple[torch.Tensor, torch.Tensor] | None = None
        # Reduced-vocabulary head (drafts): lm_head covers only these token ids [K]; logits of
        # every other token are -inf, so the draft never proposes them (still lossless).
        self.vocab_ids: torch.Tensor | None = None
        self.fast = None  # set by models.fast.accelerate: packed weights, C++ layer loop

    @property
    def activation_dtype(self) -> torch.dtype:
        """dtype of activations and of the KV cache (fp32 on the fast path)."""
        return torch.float32 if self.fast is not None else self.norm.weight.dtype

    def reduce_vocab(self, vocab_ids: torch.Tensor) -> None:
        """Keep only `vocab_ids` in the LM head (rows copied from the current head)."""
        head = nn.Linear(self.config.hidden_size, len(vocab_ids), bias=False)
        head = head.to(self.lm_head.weight.device, self.lm_head.weight.dtype)
        with torch.no_grad():
            head.weight.copy_(self.lm_head.weight[vocab_ids])
        self.lm_head = head
        self.vocab_ids = vocab_ids.to(self.lm_head.weight.device)

    def rope_tables(self, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [max_pos, head_dim], computed in float64 and cast once to `dtype` (default:
        the model dtype; the fast path asks for fp32)."""
        dtype = dtype or self.norm.weight.dtype
        if self._rope_cache is None or self._rope_cache[0].dtype != dtype:
            self._rope_cache = rope_table(self.config, dtype, self.norm.weight.device)
        return self._rope_cache

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        meta: AttentionMetadata,
        capture_layers: tuple[int, ...] = (),
    ) -> ModelOutput:
        if self.fast is not None:
            return self.fast.forward(self, input_ids, positions, meta, capture_layers)
        cos_table, sin_table = self.rope_tables()
        cos, sin = cos_table[positions].unsqueeze(1), sin_table[positions].unsqueeze(1)
        h = self.embed_tokens(input_ids)
        captured = []
        for i, layer in enumerate(self.layers):
            # in layer order, once per request of the layer (as the fast path captures)
            captured += [h] * capture_layers.count(i)
            h = layer(h, cos, sin, meta)
        captured += [h] * capture_layers.count(len(self.layers))  # the last layer's output
        return ModelOutput(self.norm(h), captured)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, H] -> [N, V] fp32
        if self.fast is not None:
            logits = self.fast.logits(hidden)
        else:
            logits = self.lm_head(hidden).float()
        if self.vocab_ids is None:
            return logits
        full = logits.new_full((*logits.shape[:-1], self.config.vocab_size), float("-inf"))
        return full.index_copy_(-1, self.vocab_ids, logits)

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Weights under Hugging Face Llama names (q/k/v and gate/up unfused)."""
        cfg = self.config
        out = {}
        for name, t in self.state_dict().items():
            t = t.detach().contiguous()
            if name == "lm_head.weight":
                if not cfg.tie_word_embeddings or self.vocab_ids is not None:
                    out[name] = t
                continue
            for hf_name, part in unfuse(name, t, cfg):
                out["model." + hf_name] = part
        return out

    def forward_dense(
        self, input_ids: torch.Tensor, capture_layers: tuple[int, ...] = ()
    ) -> ModelOutput:
        """Training/feature-extraction forward without the KV cache: input_ids [B, T] (right
        padded; padding never influences earlier tokens), plain causal attention, autograd-safe.
        Returns hidden [B, T, H] and the captured layer inputs."""
        b, t = input_ids.shape
        cos_table, sin_table = self.rope_tables()
        cos, sin = cos_table[:t].unsqueeze(1), sin_table[:t].unsqueeze(1)  # [T, 1, D]
        h = self.embed_tokens(input_ids)
        captured = []
        for i, layer in enumerate(self.layers):
            if i in capture_layers:
                captured.append(h)
            h = layer.forward_dense(h, cos, sin)
        if len(self.layers) in capture_layers:
            captured.append(h)
        return ModelOutput(self.norm(h), captured)

    # ---- weights -------------------------------------------------------------------------------

    def load_hf_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], provided: tuple[str, ...] = ()
    ) -> None:
        """Copy Hugging Face-named tensors into the fused parameters. Every parameter must be
        covered exactly, except those named in `provided` (set by the caller, e.g. shared);
        a missing or unexpected tensor raises KeyError naming it."""
        params = dict(self.named_parameters(remove_duplicate=False))
        filled: set[str] = set()
        for name, tensor in weights:
            target, offset = self._map_hf_name(name)
            if target is None:
                continue
            if target not in params:
                raise KeyError(f"unexpected tensor {name!r}")
            param = params[target]
            dst = param.data if offset is None else param.data.narrow(0, offset, tensor.shape[0])
            if dst.shape != tensor.shape:
                raise KeyError(
                    f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}"
                )
            dst.copy_(tensor)
            filled.add(target if offset is None else f"{target}@{offset}")
        self._check_filled(filled | set(provided))

    def _map_hf_name(self, name: str) -> tuple[str | None, int | None]:
        name = name.removeprefix("model.")
        if "rotary_emb.inv_freq" in name:
            return None, None
        if name == "lm_head.weight":
            return ("lm_head.weight" if not self.config.tie_word_embeddings else None), None
        cfg = self.config
        q, kv, inter = (
            cfg.num_heads * cfg.head_dim,
            cfg.num_kv_heads * cfg.head_dim,
            (cfg.intermediate_size),
        )
        fused = {
            "self_attn.q_proj": ("self_attn.qkv_proj", 0),
            "self_attn.k_proj": ("self_attn.qkv_proj", q),
            "self_attn.v_proj": ("self_attn.qkv_proj", q + kv),
            "mlp.gate_proj": ("mlp.gate_up_proj", 0),
            "mlp.up_proj": ("mlp.gate_up_proj", inter),
        }
        for part, (target, offset) in fused.items():
            if f".{part}." in name:
                return name.replace(part, target), offset
        return name, None

    def _check_filled(self, filled: set[str]) -> None:
        cfg = self.config
        q, kv, inter = (
            cfg.num_heads * cfg.head_dim,
            cfg.num_kv_heads * cfg.head_dim,
            (cfg.intermediate_size),
        )
        needed = set()
        for name, _ in self.named_parameters():
            if name.endswith("qkv_proj.weight") or name.endswith("qkv_proj.bias"):
                needed |= {f"{name}@0", f"{name}@{q}", f"{name}@{q + kv}"}
            elif name.endswith("gate_up_proj.weight"):
                needed |= {f"{name}@0", f"{name}@{inter}"}
            else:
                needed.add(name)
        missing = sorted(needed - filled)
        if missing:
            raise KeyError(f"checkpoint lacks {len(missing)} tensors, first {missing[0]!r}")
