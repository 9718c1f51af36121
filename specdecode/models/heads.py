"""Draft heads that read the frozen target's features: Medusa-1 and EAGLE-1 (drafted as
EAGLE-2 dynamic trees).

Both are small: everything large (embeddings, LM head) is the target's own, frozen and shared.
Both predict over a *draft vocabulary*: `vocab_ids` [Vd], a subset of the target's tokens (the
most frequent in the training data), whose LM-head rows are the target's. A draft restricted to
fewer tokens only ever proposes those; verification stays lossless, and on a small target the
full-vocabulary projection would otherwise cost more than the rest of the head (SmolLM2: 28M of
its 135M parameters are the LM head).

Medusa-1 (Cai et al. 2024): K heads read the target's final feature h_t (the LM head's input,
which predicts token t+1); head k predicts token t+2+k. Each head is its own residual block
h + SiLU(W h + b), zero-initialised so it starts as the identity, followed by the (shared,
frozen) vocabulary projection.

EAGLE-1 (Li et al. 2024): autoregression at the feature level. The entry at position t is
fc([embed(x_{t+1}); f_t]) where f_t is the target's final feature at t; one decoder layer (no
input norm) over the entries so far predicts f_{t+1}, whose projection gives the distribution of
x_{t+2}. Drafting feeds its own predicted features back.

Tensor names follow the public checkpoints (Medusa `medusa_head.{k}.0.linear.*`; SafeAILab
EAGLE `fc.*`, `layers.0.*`), so the loaders of issue 5 map them directly.
"""

from __future__ import annotations

import os
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from specdecode.config import ModelConfig
from specdecode.models.attention import AttentionMetadata
from specdecode.models.llama import DecoderLayer, RMSNorm, rope_table


class ResBlock(nn.Module):
    """x + SiLU(Linear(x)), starting as the identity."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


class VocabProjection(nn.Module):
    """The target's LM head restricted to `vocab_ids` (frozen rows; a buffer, never saved with
    a head). On CPU it is packed for the small-M kernels."""

    def __init__(self, lm_weight: torch.Tensor, vocab_ids: torch.Tensor | None) -> None:
        super().__init__()
        w = lm_weight.detach() if vocab_ids is None else lm_weight.detach()[vocab_ids]
        self.register_buffer("weight", w.contiguous(), persistent=False)
        self.packed = None

    def pack(self, dtype: torch.dtype) -> None:
        from specdecode import kernels

        # bf16 activations with bf16 weights where the CPU has vdpbf16ps, as `_PackedLinear`
        self.packed = kernels.pack(
            self.weight, dtype=dtype, bf16_activations=dtype == torch.bfloat16
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None and not torch.is_grad_enabled():
            from specdecode import kernels

            return kernels.linear(x.float(), self.packed)
        # (the input cast to the weight's dtype: not the whole vocabulary's weight cast to the
        # input's at every call, a copy of the LM head per draft level on a bf16 GPU target)
        return F.linear(x.to(self.weight.dtype), self.weight).float()


class MedusaHeads(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int, num_layers: int = 1) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.medusa_head = nn.ModuleList(
            nn.Sequential(*[ResBlock(hidden_size) for _ in range(num_layers)])
            for _ in range(num_heads)
        )
        self.proj: VocabProjection | None = None  # attach()
        self.vocab_ids: torch.Tensor | None = None
        self._own = 0  # imported per-head projections, as buffers own_proj_{k} (`own_projections`)

    @property
    def own_projections(self) -> list[torch.Tensor] | None:
        """The per-head vocabulary projections of an imported Medusa checkpoint (None: the
        target's LM head). Buffers, not saved with a head: they move with the module (`.to`)."""
        return [getattr(self, f"own_proj_{k}") for k in range(self._own)] if self._own else None

    @own_projections.setter
    def own_projections(self, weights: list[torch.Tensor] | None) -> None:
        for k in range(self._own):
            delattr(self, f"own_proj_{k}")
        self._own = len(weights or [])
        for k, w in enumerate(weights or []):
            self.register_buffer(f"own_proj_{k}", w, persistent=False)

    @property
    def num_heads(self) -> int:
        return len(self.medusa_head)

    def attach(self, lm_weight: torch.Tensor, vocab_ids: torch.Tensor | None) -> None:
        self.proj = VocabProjection(lm_weight, vocab_ids)
        self.vocab_ids = vocab_ids

    def features(self, h: torch.Tensor) -> torch.Tensor:  # [..., H] -> [..., K, H]
        return torch.stack([head(h) for head in self.medusa_head], dim=-2)

    def forward(self, h: torch.Tensor) -> torch.Tensor:  # [..., H] -> [..., K, Vd] fp32 logits
        feats = self.features(h)
        if self.own_projections is not None:
            return torch.stack(
                [
                    F.linear(feats[..., k, :], w.to(feats.dtype)).float()
                    for k, w in enumerate(self.own_projections)
                ],
                dim=-2,
            )
        return self.proj(feats)


class _PackedLinear(nn.Module):
    """An inference-only stand-in for nn.Linear on the CPU small-M kernels. bf16 weights take
    bf16 activations where the CPU multiplies bf16 pairs (vdpbf16ps: half the compute of a tree
    level's rows; a head only proposes, so its rounding never touches exactness)."""

    def __init__(self, linear: nn.Linear, dtype: torch.dtype) -> None:
        super().__init__()
        from specdecode import kernels

        bias = linear.bias.detach().float() if linear.bias is not None else None
        self.p = kernels.pack(
            linear.weight.detach(), bias, dtype=dtype, bf16_activations=dtype == torch.bfloat16
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from specdecode import kernels

        return kernels.linear(x, self.p)


class EagleHead(nn.Module):
    """EAGLE-1/2 head: fc over [embedding; feature], one decoder layer without input norm."""

    kind = "eagle"

    def __init__(
        self, cfg: ModelConfig, feature_size: int | None = None, fc_bias: bool = False
    ) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.config = replace(cfg, num_layers=1)
        self.feature_size = feature_size or h
        # SafeAILab's EAGLE-1 has an fc bias by default; vLLM's EAGLE loader has none
        self.fc = nn.Linear(h + self.feature_size, h, bias=fc_bias)
        self.layers = nn.ModuleList([DecoderLayer(self.config, 0)])
        self.layers[0].input_layernorm = nn.Identity()
        self._embed: list[nn.Embedding] = []  # the target's (not a submodule: never saved)
        self.proj: VocabProjection | None = None
        self.vocab_ids: torch.Tensor | None = None
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None
        self._fast: _FastLayer | None = None

    # ---- wiring to the target ----------------------------------------------------------------

    def attach(
        self, embed: nn.Embedding, lm_weight: torch.Tensor, vocab_ids: torch.Tensor | None
    ) -> None:
        self._embed = [embed]
        self.proj = VocabProjection(lm_weight, vocab_ids)
        self.vocab_ids = vocab_ids

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self._embed[0](ids)

    def accelerate(self, dtype: torch.dtype) -> None:
        """Pack every projection for the CPU kernels (inference only)."""
        from specdecode import kernels

        if self.fc.weight.device.type != "cpu" or not kernels.available():  # (no build)
            return
        self._pack_layer(dtype)
        self.proj.pack(dtype)

    def _pack_layer(self, dtype: torch.dtype) -> None:
        self.fc = _PackedLinear(self.fc, dtype)
        layer = self.layers[0]
        layer.self_attn.qkv_proj = _PackedLinear(layer.self_attn.qkv_proj, dtype)
        layer.self_attn.o_proj = _PackedLinear(layer.self_attn.o_proj, dtype)
        layer.mlp.gate_up_proj = _PackedLinear(layer.mlp.gate_up_proj, dtype)
        layer.mlp.down_proj = _PackedLinear(layer.mlp.down_proj, dtype)
        if os.environ.get(LAYER_LOOP_ENV, "") != "0":
            norm = getattr(self, "norm", None)
            self._fast = _FastLayer(self, norm.weight if norm is not None else None)

    def rope_tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [max_pos, D] in fp32 on `device` (built once)."""
        if self._rope is None or self._rope[0].device != device:
            self._rope = rope_table(self.config, torch.float32, device)
        return self._rope

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, D] in fp32 for these positions."""
        cos, sin = self.rope_tables(positions.device)
        return cos[positions].unsqueeze(-2), sin[positions].unsqueeze(-2)

    # ---- forward -----------------------------------------------------------------------------

    def _attn_input(self, ids: torch.Tensor, feats: torch.Tensor):
        """(input of q/k/v, residual stream) for entries (token, feature)."""
        h = self.fc(torch.cat([self.embed(ids).to(feats.dtype), feats], -1))
        return h, h  # EAGLE-1: no input norm

    def _body(self, x, residual, cos, sin, meta=None):
        """The decoder layer on a prepared attention input: paged (meta) or dense causal."""
        layer = self.layers[0]
        attn = layer.self_attn
        if meta is None:
            h = residual + attn.forward_dense(x, cos, sin)
        else:
            h = residual + attn(x, cos, sin, meta)
        return self._output(h + layer.mlp(layer.post_attention_layernorm(h)))

    def _output(self, h: torch.Tensor) -> torch.Tensor:
        """What a draft step passes on (the next step's hidden state, the logits' input)."""
        return h

    def forward(
        self,
        ids: torch.Tensor,  # [T] token after each feature
        feats: torch.Tensor,  # [T, F] target features, or [T, H] the head's own predictions
        positions: torch.Tensor,  # [T]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, H] predictions, fed back as `feats` for the next draft step
        x, residual = self._attn_input(ids, feats.float())
        if self._fast is not None and not torch.is_grad_enabled():
            normed, h = self._fast(x, residual, positions, meta)
            return self._fast_output(h, normed)
        cos, sin = self.rope(positions)
        return self._body(x, residual, cos, sin, meta)

    def _fast_output(self, h: torch.Tensor, normed: torch.Tensor) -> torch.Tensor:
        """`_output` from the fast layer's results: the layer's output h and norm(h)."""
        return h

    def logits(self, predicted: torch.Tensor) -> torch.Tensor:  # [N, H] -> [N, Vd] fp32
        return self.proj(predicted)  # EAGLE-1 predicts the target's final feature itself

    def forward_dense(self, ids: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
        """Training: ids [B, T] (x_{t+1}), feats [B, T, F] (f_t) -> predictions [B, T, H]
        with causal attention over the T entries."""
        t = ids.shape[1]
        x, residual = self._attn_input(ids, feats)
        cos, sin = self.rope(torch.arange(t, device=ids.device))
        return self._body(x, residual, cos.to(x.dtype), sin.to(x.dtype))

    def forward_unrolled(
        self, ids: torch.Tensor, feats: torch.Tensor, steps: int
    ) -> list[torch.Tensor]:
        """Training-time test (EAGLE-3) and per-position evaluation: `steps` draft steps
        unrolled over every position at once, each step fed the previous step's predictions.

        Step j (0-based) at origin t is the entry (prediction of step j-1 at t, x_{t+j+1}) at
        position t+j. It attends to the true entries 0..t (step 0), to the entries of earlier
        steps at the same origin t, and to itself: exactly what it would see when drafting
        j+1 tokens after position t. ids [B, T + steps] (x_1...), feats [B, T, F].
        Returns one [B, T, H] prediction per step (step j predicts the distribution of token
        t+j+2).
        """
        b, t = feats.shape[:2]
        layer = self.layers[0]
        attn = layer.self_attn
        keys, values, outs = [], [], []
        x = feats
        for j in range(steps):
            inp, residual = self._attn_input(ids[:, j : j + t], x)
            cos, sin = self.rope(torch.arange(j, j + t, device=ids.device))
            cos, sin = cos.to(inp.dtype), sin.to(inp.dtype)
            q, k, v = attn._project(inp, cos, sin)  # [B, T, heads, D]
            keys.append(k.transpose(1, 2))
            values.append(v.transpose(1, 2))
            out = _ttt_attention(q.transpose(1, 2), keys, values, attn.num_heads)
            h = residual + attn.o_proj(out.transpose(1, 2).reshape(b, t, attn.q_size))
            pred = self._output(h + layer.mlp(layer.post_attention_layernorm(h)))
            outs.append(pred)
            x = pred
        return outs


LAYER_LOOP_ENV = "SPECDECODE_HEAD_LAYER_LOOP"  # "0": a packed head's layer runs op by op


class _FastLayer:
    """A packed head's decoder layer as one call of the C++ layer loop (`fast.py`'s, given
    the attention input): paged drafting only. Python dispatch of the layer's ~20 ops was most
    of a draft step on a small head (measured on SmolLM2's EAGLE-3 head, 2 Zen 4 cores: 0.6-0.8
    ms per level, ~0.15 ms of it the weights). Returns (norm(h), h) for the layer's output h,
    `norm` the head's final norm (EAGLE-3) or none (EAGLE-1: ones, its result unused)."""

    def __init__(self, head: EagleHead, norm_weight: torch.Tensor | None) -> None:
        from specdecode import kernels
        from specdecode.models.fast import layer_dims, layer_weights

        self.ext = kernels.load_extension()
        cfg = head.config
        layer = head.layers[0]
        attn, mlp = layer.self_attn, layer.mlp
        packs = [m.p for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
        self.bf16_activations = packs[0].bf16_activations  # as `_PackedLinear` packed them all
        self.weights = layer_weights(layer, *packs, input_norm=False)
        final = norm_weight if norm_weight is not None else torch.ones(cfg.hidden_size)
        self.weights.append(final.detach().float().contiguous())
        self.dims = layer_dims(cfg)
        self.eps = cfg.rms_norm_eps
        self.cos, self.sin = head.rope_tables(torch.device("cpu"))  # (the eager path's)

    def __call__(self, x, residual, positions, meta) -> tuple[torch.Tensor, torch.Tensor]:
        from specdecode.models.fast import layer_loop

        out = layer_loop(
            self.ext, residual.float(), self.cos[positions], self.sin[positions], meta,
            self.weights, self.dims, self.eps, self.bf16_activations, [1], x.float(),
        )  # fmt: skip
        return out[0], out[1]


def _ttt_attention(q, keys, values, num_heads):
    """q [B, Hq, T, D]; keys/values: per step [B, Hkv, T, D]. Causal over step 0's keys,
    diagonal (same origin) over later steps'."""
    b, _, t, d = q.shape
    rep = num_heads // keys[0].shape[1]
    ks = [k.repeat_interleave(rep, 1) for k in keys]
    vs = [v.repeat_interleave(rep, 1) for v in values]
    scale = d**-0.5
    causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    scores = [(q @ ks[0].transpose(-1, -2)).masked_fill(~causal, float("-inf")) * scale]
    scores += [(q * k).sum(-1, keepdim=True) * scale for k in ks[1:]]  # [B, H, T, 1]
    probs = torch.cat(scores, -1).softmax(-1)
    out = probs[..., :t] @ vs[0]
    for i, v in enumerate(vs[1:]):
        out = out + probs[..., t + i : t + i + 1] * v
    return out


def vocab_maps(vocab_ids: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """SafeAILab / vLLM draft-vocabulary maps: d2t [Vd] (target id = draft id + d2t[draft id])
    and t2d [V] (True for target ids in the draft vocabulary)."""
    vocab = vocab_ids.detach().cpu().long()
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[vocab] = True
    return vocab - torch.arange(vocab.numel()), t2d


# speculators' EAGLE-3 variants, as config.json names them (`Eagle3Head.set_variant`)
EAGLE3_VARIANTS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")


def eagle3_aux_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's low, mid and high layers: the residual streams entering layers 2, N//2, N-3
    (distinct layers of a smaller model's own span when it has fewer than 6)."""
    n = num_layers
    return (2, n // 2, n - 3) if n >= 7 else tuple(sorted({0, n // 2, n - 1}))


class Eagle3Head(EagleHead):
    """EAGLE-3 (Li et al. 2025): fc maps the target's concatenated low/mid/high layer inputs
    (3H) to H; the layer's attention reads [input_norm(embedding); hidden_norm(hidden)] (2H) with
    the hidden state as residual; logits = lm_head(norm(output)) over the draft vocabulary with
    its own (trained) LM head. Later draft steps feed the head's own pre-norm output back as the
    hidden state (no fc). Draft token i maps to target token `vocab_ids[i]` (checkpoints store
    d2t = vocab_ids - arange, and t2d, as SafeAILab and vLLM do)."""

    kind = "eagle3"

    def __init__(
        self,
        cfg: ModelConfig,
        draft_vocab_size: int,
        aux_layers: tuple[int, ...] | None = None,
    ) -> None:
        nn.Module.__init__(self)
        h = cfg.hidden_size
        self.config = replace(cfg, num_layers=1)
        # the target layers whose inputs are the low/mid/high features, ascending
        self.aux_layers = tuple(sorted(aux_layers or eagle3_aux_layers(cfg.num_layers)))
        self.feature_size = len(self.aux_layers) * h
        self.fc = nn.Linear(self.feature_size, h, bias=False)
        layer = DecoderLayer(self.config, 0)
        attn = layer.self_attn
        attn.qkv_proj = nn.Linear(2 * h, attn.q_size + 2 * attn.kv_size, bias=cfg.attention_bias)
        layer.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.layers = nn.ModuleList([layer])
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(h, draft_vocab_size, bias=False)
        self._embed = []
        self.proj = None
        self.vocab_ids = None
        self._rope = None
        self._fast = None
        self.set_variant()

    def set_variant(
        self,
        norm_before_residual: bool = False,
        norm_before_fc: bool = False,
        fc_norm: bool = False,
        norm_output: bool = False,
    ) -> None:
        """The EAGLE-3 variants of speculators' config (which vLLM reads too):
        `norm_before_residual`, the layer's residual is the normalised hidden state;
        `norm_before_fc`, one RMSNorm over the concatenated features before fc (`input_norm`);
        `fc_norm`, an RMSNorm per feature before fc (EAGLE 3.1); `norm_output`, a draft step
        passes on its output after the final norm (EAGLE 3.1), so later steps read normalised
        hidden states. New norms start as identities."""
        if norm_before_fc and fc_norm:
            raise ValueError("norm_before_fc and fc_norm exclude each other")
        h, eps = self.config.hidden_size, self.config.rms_norm_eps
        self.norm_before_residual = bool(norm_before_residual)
        self.input_norm = RMSNorm(self.feature_size, eps) if norm_before_fc else None
        n = len(self.aux_layers)
        self.fc_norm = nn.ModuleList(RMSNorm(h, eps) for _ in range(n)) if fc_norm else None
        self.norm_output = bool(norm_output)

    @property
    def variant(self) -> dict[str, bool]:
        """`set_variant`'s flags, as config.json names them."""
        on = (self.norm_before_residual, self.input_norm is not None, self.fc_norm is not None,
              self.norm_output)  # fmt: skip
        return dict(zip(EAGLE3_VARIANTS, on, strict=True))

    def attach(self, embed: nn.Embedding, vocab_ids: torch.Tensor | None) -> None:  # type: ignore[override]
        if vocab_ids is not None and vocab_ids.numel() != self.lm_head.out_features:
            raise ValueError("the draft vocabulary does not match the LM head")
        self._embed = [embed]
        self.vocab_ids = vocab_ids

    def accelerate(self, dtype: torch.dtype) -> None:
        from specdecode import kernels

        if self.fc.weight.device.type != "cpu" or not kernels.available():  # (no build)
            return
        self._pack_layer(dtype)
        self.lm_head = _PackedLinear(self.lm_head, dtype)

    def _fc_input(self, feats: torch.Tensor) -> torch.Tensor:
        if self.input_norm is not None:
            return self.input_norm(feats)
        if self.fc_norm is not None:
            parts = feats.chunk(len(self.fc_norm), -1)
            return torch.cat([norm(x) for norm, x in zip(self.fc_norm, parts, strict=True)], -1)
        return feats

    def _attn_input(self, ids: torch.Tensor, feats: torch.Tensor):
        # the target's features (3H) go through fc; a draft step's own output is the state
        h = self.fc(self._fc_input(feats)) if feats.shape[-1] == self.feature_size else feats
        layer = self.layers[0]
        e = layer.input_layernorm(self.embed(ids).to(h.dtype))
        hn = layer.hidden_norm(h)
        return torch.cat([e, hn], -1), (hn if self.norm_before_residual else h)

    def _output(self, h: torch.Tensor) -> torch.Tensor:
        return self.norm(h) if self.norm_output else h

    def _fast_output(self, h: torch.Tensor, normed: torch.Tensor) -> torch.Tensor:
        return normed if self.norm_output else h

    def logits(self, predicted: torch.Tensor) -> torch.Tensor:
        x = predicted if self.norm_output else self.norm(predicted)  # (normalised already)
        return self.lm_head(x).float()
