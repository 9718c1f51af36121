"""Saving and loading draft heads (safetensors + config.json), and wiring them to a target.

Layouts (a directory each):
- Medusa: config.json with Medusa's keys (`medusa_num_heads`, `medusa_num_layers`) plus a
  `specdecode_head` section; model.safetensors with `medusa_head.{k}.{l}.linear.{weight,bias}`
  and `vocab_ids` (the draft vocabulary; the projection rows are the target's LM head).
- EAGLE: a Llama-style config.json of the one-layer head plus `specdecode_head`; tensors
  `fc.{weight,bias}` and `layers.0.*` with unfused q/k/v and gate/up (SafeAILab's names),
  and `vocab_ids`.
The target's embeddings and LM head are never stored: heads attach to the target at load.
"""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from specdecode.config import ModelConfig
from specdecode.errors import CorruptModelError, InvalidRequestError, UnsupportedModelError
from specdecode.models.heads import Eagle3Head, EagleHead, MedusaHeads, vocab_maps
from specdecode.models.llama import LlamaModel, unfuse

if TYPE_CHECKING:
    from specdecode.config import SpeculativeConfig
    from specdecode.engine.engine import LLMEngine

ASSETS = Path(__file__).resolve().parent.parent / "assets"
log = logging.getLogger(__name__)


def target_signature(model: LlamaModel) -> dict:
    """What a head records of the target it was trained on: its depth and a sample of its
    embeddings (16 rows x 8 columns spread over the table), compared by cosine so that another
    precision or quantization of the same model matches and another model does not."""
    w = model.embed_tokens.weight
    step = max(1, w.shape[0] // 16)
    rows = torch.arange(min(16, w.shape[0])) * step + min(7, step - 1)
    sample = w.detach()[rows.to(w.device), :8].float().flatten().cpu()
    return {
        "num_hidden_layers": model.config.num_layers,
        "embedding_sample": [round(float(x), 5) for x in sample],
    }


def _check_target(path: Path, recorded: dict | None, target: LlamaModel) -> None:
    """Warn where a head was trained on another target than the one it is given (same width
    and vocabulary, or it would not load): it drafts poorly there (the output stays exact)."""
    if not isinstance(recorded, dict):
        return  # (heads from elsewhere, or trained before heads recorded it)
    now = target_signature(target)
    why = None
    if recorded.get("num_hidden_layers") not in (None, now["num_hidden_layers"]):
        why = f"{recorded['num_hidden_layers']} layers, this one has {now['num_hidden_layers']}"
    sample = recorded.get("embedding_sample")
    if why is None and isinstance(sample, list) and len(sample) == len(now["embedding_sample"]):
        a, b = torch.tensor(sample, dtype=torch.float64), torch.tensor(now["embedding_sample"])
        cos = float(torch.nn.functional.cosine_similarity(a, b.double(), dim=0))
        if cos < 0.9:
            why = f"its embeddings differ (cosine {cos:.2f} on a sample)"
    if why is not None:
        log.warning(
            "%s was trained on another target model (%s): it will draft poorly for this one "
            "(the output is still exact)", path, why,
        )  # fmt: skip


def _unfused(module: torch.nn.Module, config: ModelConfig) -> dict[str, torch.Tensor]:
    """State dict with q/k/v and gate/up split under Hugging Face names."""
    out = {}
    for name, t in module.state_dict().items():
        out.update(unfuse(name, t.detach().contiguous(), config))
    return out


def save_head(
    head, out_dir: Path, target_config: ModelConfig, info: dict, target: dict | None = None
) -> None:
    """Write `head` (safetensors + config.json); `target`: its target's `target_signature`."""
    from specdecode.models.loader import write_safetensors

    out_dir.mkdir(parents=True, exist_ok=True)
    c = target_config
    if isinstance(head, MedusaHeads):
        tensors = {k: v.detach().contiguous() for k, v in head.state_dict().items()}
        config = {
            "architectures": ["MedusaModel"],
            "medusa_num_heads": head.num_heads,
            "medusa_num_layers": len(head.medusa_head[0]),
            "hidden_size": c.hidden_size,
            "vocab_size": c.vocab_size,
        }
        kind = "medusa"
    else:
        tensors = _unfused(head, head.config)
        eagle3 = isinstance(head, Eagle3Head)
        if eagle3:  # SafeAILab's EAGLE-3 names: the layer is `midlayer`, the map is d2t / t2d
            tensors = {k.replace("layers.0.", "midlayer."): v for k, v in tensors.items()}
            if head.vocab_ids is not None:  # (a head over the whole vocabulary has no map)
                tensors["d2t"], tensors["t2d"] = vocab_maps(head.vocab_ids, c.vocab_size)
        config = {
            "architectures": ["LlamaForCausalLMEagle3" if eagle3 else "EagleLlamaForCausalLM"],
            **head.config.hf_dict(num_layers=1),  # the head's own layer shape
            "model_type": "llama",  # the head's layer is a Llama layer whatever the target
            "bias": getattr(head.fc, "bias", None) is not None,
        }
        if eagle3:
            config["draft_vocab_size"] = int(head.lm_head.out_features)
            config["eagle_aux_hidden_state_layer_ids"] = list(head.aux_layers)
            config.update({k: v for k, v in head.variant.items() if v})  # (off: not written)
        kind = head.kind
    if head.vocab_ids is not None and kind != "eagle3":
        tensors["vocab_ids"] = head.vocab_ids.detach().cpu().to(torch.int64)
    config["specdecode_head"] = {
        "kind": kind,
        "draft_vocab_size": int(head.vocab_ids.numel()) if head.vocab_ids is not None else None,
        **({"target": target} if target is not None else {}),
        **info,
    }
    # written aside, then renamed: a run killed while saving a checkpoint keeps the last one
    write_safetensors(
        {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in tensors.items()},
        out_dir / "model.safetensors",
    )
    (out_dir / "config.tmp").write_text(json.dumps(config, indent=2))
    (out_dir / "config.tmp").replace(out_dir / "config.json")


def head_layer_config(raw: dict, tc: ModelConfig) -> ModelConfig:
    """The head's decoder layer as its checkpoint's config.json describes it (MLP width, heads,
    head size, norm epsilon, RoPE), the target's for what it does not name. A head need not
    copy its target's layer shape (speculators and SafeAILab write their own). The family
    (q/k/v biases), the vocabulary and the context length stay the target's: the head runs at
    the target's positions over its tokens."""
    from specdecode.config import rope_from_hf

    try:
        heads = int(raw.get("num_attention_heads") or tc.num_heads)
        kv_default = heads if raw.get("num_attention_heads") else tc.num_kv_heads
        dim_default = tc.hidden_size // heads if raw.get("num_attention_heads") else tc.head_dim
        # RoPE as the engines read a layer's config: a config that describes the layer (names
        # its heads) and no RoPE means Hugging Face's default (theta 10000), as vLLM and SGLang
        # load it and the head was trained; a config naming no layer keeps the target's
        named_rope = any(raw.get(k) for k in ("rope_theta", "rope_scaling", "rope_parameters"))
        rope = rope_from_hf(raw) if named_rope or raw.get("num_attention_heads") else tc.rope
        cfg = replace(
            tc,
            intermediate_size=int(raw.get("intermediate_size") or tc.intermediate_size),
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or kv_default),
            head_dim=int(raw.get("head_dim") or dim_default),
            rms_norm_eps=float(raw.get("rms_norm_eps") or tc.rms_norm_eps),
            rope=rope,
        )
    except (TypeError, ValueError, KeyError, AttributeError) as e:
        raise InvalidRequestError(f"the head's config.json has a bad layer field ({e})") from None
    except UnsupportedModelError as e:
        raise InvalidRequestError(f"the head's config.json: {e}") from None
    if min(cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) < 1 or (
        cfg.num_heads % cfg.num_kv_heads
    ):
        raise InvalidRequestError(
            f"the head's config.json describes no valid layer ({cfg.num_heads} heads, "
            f"{cfg.num_kv_heads} key-value heads, head size {cfg.head_dim}, MLP width "
            f"{cfg.intermediate_size})"
        )
    return cfg


def _read_config(path: Path) -> dict:
    cfg = path / "config.json"
    if not cfg.is_file():
        raise InvalidRequestError(f"{path} has no config.json: not a head directory")
    try:
        raw = json.loads(cfg.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CorruptModelError(f"{cfg} is not valid JSON: {e}") from None
    layer = raw.get("transformer_layer_config", {}) if isinstance(raw, dict) else None
    if not isinstance(layer, dict) or not isinstance(raw.get("specdecode_head", {}), dict):
        raise CorruptModelError(f"{cfg} is not a head's config (a JSON object of its fields)")
    # speculators nests the layer's shape under transformer_layer_config
    return {**layer, **raw}


def _weight_files(path: Path) -> list[Path]:
    files = sorted(path.glob("*.safetensors"))
    if files:
        return files
    return sorted(path.glob("*.bin")) + sorted(path.glob("*.pt"))


def head_kind(path: Path) -> str | None:
    """medusa | eagle | eagle3 for our heads and for SafeAILab, speculators and Medusa
    checkpoints; None if unrecognised."""
    if not (path / "config.json").is_file():
        return None
    raw = _read_config(path)
    if "specdecode_head" in raw:
        return raw["specdecode_head"].get("kind")
    if "specdecode_draft" in raw:  # a draft model `train draft` wrote (one layer, maybe)
        return None
    spec = raw.get("speculators_model_type")
    if spec in ("eagle3", "eagle"):
        return spec
    arch = " ".join(raw.get("architectures") or [])
    if "medusa_num_heads" in raw or "Medusa" in arch or raw.get("model_type") == "medusa":
        return "medusa"
    if "Eagle3" in arch or "draft_vocab_size" in raw:
        return "eagle3"
    if "Eagle" in arch or (raw.get("num_hidden_layers") == 1 and _has_fc(path)):
        return "eagle"  # (SafeAILab's EAGLE-1 config is a one-layer Llama's: its fc tells)
    return None


def _has_fc(path: Path) -> bool:
    """Whether a one-layer checkpoint has EAGLE's fc, by its safetensors headers (a one-layer
    draft model has none); a pickle checkpoint, not read here, is taken for the head its config
    looks like."""
    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors"))
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as st:
                if any(k.endswith("fc.weight") for k in st.keys()):  # noqa: SIM118
                    return True
        except Exception:  # noqa: BLE001 - a damaged file: loading it says what is wrong
            return True
    return not files


def _load_tensors(path: Path, allow_pickle: bool) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = _weight_files(path)
    if not files:
        raise InvalidRequestError(f"{path} holds no weights (*.safetensors)")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        if f.suffix != ".safetensors" and not allow_pickle:
            raise InvalidRequestError(
                f"{f.name} is a pickle checkpoint, which can run code; convert it to safetensors "
                "or pass --allow-pickle"
            )
        try:
            if f.suffix == ".safetensors":
                tensors.update(load_file(str(f)))
            else:
                tensors.update(torch.load(str(f), map_location="cpu", weights_only=True))
        except Exception as e:  # safetensors' and torch's errors for a truncated or bad file
            raise CorruptModelError(f"{f} cannot be read ({type(e).__name__}: {e})") from None
    return tensors


def _check_vocab(path: Path, vocab_ids: torch.Tensor, vocab_size: int, rows: int | None) -> None:
    """A draft vocabulary (vocab_ids, token_map, d2t + arange) is distinct target ids, one per
    row of the head's own projection where it has one."""
    ok = (
        vocab_ids.dim() == 1
        and vocab_ids.unique().numel() == vocab_ids.numel()
        and bool(((vocab_ids >= 0) & (vocab_ids < vocab_size)).all())
        and (rows is None or vocab_ids.numel() == rows)
    )
    if not ok:
        want = f"{rows} " if rows is not None else ""
        raise CorruptModelError(
            f"{path}: the head's draft vocabulary is not {want}distinct token ids below the "
            f"target's vocabulary size ({vocab_size})"
        )


def _refuse_draft(path: Path, raw: dict) -> None:
    if "specdecode_draft" in raw:
        raise InvalidRequestError(
            f"{path} is a draft model from `specdecode train draft`, not a head: it runs as "
            "method draft_model (and, sharing its target's embeddings, is not exported)"
        )


def load_head(
    path: Path,
    target: LlamaModel,
    allow_pickle: bool = False,
    token_map: torch.Tensor | None = None,
):
    """A head directory (ours, SafeAILab EAGLE-1/EAGLE-3, speculators, or Medusa), attached to
    `target` (its embeddings and, unless the head has its own, its LM head rows). `token_map`
    (target ids, `models.token_map`) replaces the draft vocabulary of a head that scores with
    the target's LM head rows (EAGLE-1, Medusa), or picks rows of a Medusa head's own
    whole-vocabulary projections."""
    path = Path(path)
    raw = _read_config(path)
    _refuse_draft(path, raw)
    kind = head_kind(path)
    tc = target.config
    # FasterDecoding's Medusa config names no sizes: the tensors' shapes are checked below
    hidden = raw.get("hidden_size", tc.hidden_size if kind == "medusa" else None)
    if raw.get("target_hidden_size") == tc.hidden_size and hidden != tc.hidden_size:
        raise InvalidRequestError(
            f"{path}: the head's own hidden size ({hidden}) differs from its target's "
            f"({tc.hidden_size}, its target_hidden_size); heads of another width than their "
            "target are not supported here"
        )
    if hidden != tc.hidden_size or raw.get("vocab_size", tc.vocab_size) != tc.vocab_size:
        raise InvalidRequestError(f"{path} was trained for a different target model")
    _check_target(path, (raw.get("specdecode_head") or {}).get("target"), target)
    tensors = _load_tensors(path, allow_pickle)
    vocab_ids = tensors.pop("vocab_ids", None)
    lc = tc if kind == "medusa" else head_layer_config(raw, tc)
    # Qwen3-style q/k norms in the head's layer where its checkpoint has them (heads trained
    # here before they became Llama layers); none otherwise, whatever the target
    lc = replace(lc, qk_norm=any(k.endswith("self_attn.q_norm.weight") for k in tensors))
    device = target.norm.weight.device
    if kind == "medusa":
        head, own_map = _load_medusa(raw, tensors, tc)  # (vLLM's token_map: its rows' ids)
        vocab_ids = own_map if own_map is not None else vocab_ids
    elif kind == "eagle":
        tensors = {k.removeprefix("model."): v for k, v in tensors.items()}
        tensors.pop("embed_tokens.weight", None)  # SafeAILab stores the target's copy
        head = EagleHead(lc, fc_bias="fc.bias" in tensors)
        _load_layer_weights(head, tensors)
    elif kind == "eagle3":
        head, vocab_ids = _load_eagle3(raw, tensors, lc)
    else:
        raise InvalidRequestError(f"{path}: not a Medusa, EAGLE or EAGLE-3 head")
    head = head.to(device)
    if token_map is not None:
        vocab_ids = _apply_token_map(path, kind, head, vocab_ids, token_map)
    if vocab_ids is not None:
        vocab_ids = vocab_ids.long()
        rows = None
        if kind == "eagle3":
            rows = head.lm_head.out_features
        elif kind == "medusa" and head.own_projections is not None:
            rows = head.own_projections[0].shape[0]
        _check_vocab(path, vocab_ids, tc.vocab_size, rows)
        vocab_ids = vocab_ids.to(device)
    if kind == "medusa":
        head.attach(target.lm_head.weight, vocab_ids)
    elif kind == "eagle3":
        head.attach(target.embed_tokens, vocab_ids)
    else:
        head.attach(target.embed_tokens, target.lm_head.weight, vocab_ids)
    return head.eval().requires_grad_(False)


def _apply_token_map(path: Path, kind: str, head, vocab_ids, token_map: torch.Tensor):
    """The draft vocabulary a token map gives a head (its ids replace the head's own, the
    rows being the target's), or a clear error where the head's LM head is its own."""
    if kind == "eagle3":
        raise InvalidRequestError(
            f"{path}: an EAGLE-3 head has its own draft vocabulary (d2t); a token map does not "
            "apply to it"
        )
    if kind == "medusa" and head.own_projections is not None:
        if vocab_ids is not None:  # its own rows are a vocabulary of its own already
            raise InvalidRequestError(
                f"{path}: this Medusa head's own projections cover a reduced vocabulary "
                f"({vocab_ids.numel()} tokens, its token_map); a token map cannot choose "
                "other rows"
            )
        keep = token_map.to(head.own_projections[0].device)
        head.own_projections = [w[keep].contiguous() for w in head.own_projections]
    return token_map


def _load_medusa(
    raw: dict, tensors: dict[str, torch.Tensor], tc: ModelConfig
) -> tuple[MedusaHeads, torch.Tensor | None]:
    """Ours (`medusa_head.{i}.{j}.linear.*`), FasterDecoding (`{i}.{j}.linear.*`, vocabulary
    projection `{i}.{L}.weight`) or vLLM (`blocks.{i}.layers.{j}.*`, `lm_heads.{i}.weight`; a
    draft vocabulary as `token_map`, used as vLLM does: when `truncated_vocab_size` is below
    the target's). Returns the heads and that draft vocabulary (None: the target's)."""
    import re

    heads_n = raw.get("medusa_num_heads") or raw.get("num_heads")
    layers_n = raw.get("medusa_num_layers") or raw.get("num_hidden_layers") or 1
    if not heads_n:
        raise InvalidRequestError("the Medusa config lacks medusa_num_heads / num_heads")
    token_map = tensors.pop("token_map", None)
    truncated = raw.get("truncated_vocab_size") or tc.vocab_size
    if token_map is not None and int(truncated) < tc.vocab_size:
        token_map = token_map.long().flatten()
        if (
            token_map.numel() != int(truncated)
            or token_map.unique().numel() != token_map.numel()
            or not bool(((token_map >= 0) & (token_map < tc.vocab_size)).all())
        ):
            raise InvalidRequestError(
                f"the Medusa checkpoint's token_map is not {truncated} distinct ids of the "
                f"target's {tc.vocab_size}-token vocabulary"
            )
    else:
        token_map = None
    state, proj = {}, {}
    for name, t in tensors.items():
        name = name.removeprefix("medusa_heads.").removeprefix("medusa_head.")
        m = re.fullmatch(
            r"(?:blocks\.)?(\d+)\.(?:layers\.)?(\d+)\.(?:linear\.)?(weight|bias)", name
        )
        n = re.fullmatch(r"(?:lm_heads\.)?(\d+)\.?(\d+)?\.?weight", name)
        if m and int(m.group(2)) < layers_n:
            state[f"medusa_head.{m.group(1)}.{m.group(2)}.linear.{m.group(3)}"] = t.float()
        elif m and int(m.group(2)) == layers_n and m.group(3) == "weight":
            proj[int(m.group(1))] = t.float()
        elif n and name.startswith("lm_heads."):
            proj[int(n.group(1))] = t.float()
        elif name == "lm_head.weight":  # vLLM original_lm_head: the target's, shared
            continue
        else:
            raise InvalidRequestError(f"unexpected tensor {name!r} in the Medusa checkpoint")
    head = MedusaHeads(tc.hidden_size, int(heads_n), int(layers_n))
    missing = head.load_state_dict(state, strict=False).missing_keys
    if missing:
        raise InvalidRequestError(f"the Medusa checkpoint lacks {missing[0]!r}")
    for name, t in state.items():
        if t.shape[-1] != tc.hidden_size:
            raise InvalidRequestError(
                f"the Medusa checkpoint's {name} is {list(t.shape)}: trained for a target of "
                f"hidden size {t.shape[-1]}, not {tc.hidden_size}"
            )
    if proj:
        if sorted(proj) != list(range(int(heads_n))):
            raise InvalidRequestError("the Medusa checkpoint has projections for some heads only")
        if token_map is not None:  # vLLM keeps a full projection's draft rows
            proj = {i: w[token_map] if w.shape[0] == tc.vocab_size else w for i, w in proj.items()}
        n = tc.vocab_size if token_map is None else token_map.numel()
        rows = {tuple(w.shape) for w in proj.values()}
        if rows != {(n, tc.hidden_size)}:
            raise InvalidRequestError(
                f"the Medusa checkpoint projects to {sorted(rows)}; the target needs "
                f"[{n}, {tc.hidden_size}]"
            )
        head.own_projections = [proj[i] for i in range(int(heads_n))]
    return head, token_map


def _load_eagle3(raw: dict, tensors: dict[str, torch.Tensor], tc: ModelConfig):
    """SafeAILab (`midlayer.*`) or speculators (`layers.0.*`) names; d2t gives the vocabulary."""
    tensors = {k.removeprefix("model."): v for k, v in tensors.items()}
    tensors = {k.replace("midlayer.", "layers.0."): v for k, v in tensors.items()}
    tensors.pop("embed_tokens.weight", None)  # some checkpoints carry the target's copy
    d2t = tensors.pop("d2t", None)
    t2d = tensors.pop("t2d", None)
    if "lm_head.weight" not in tensors:
        raise InvalidRequestError("the EAGLE-3 checkpoint has no lm_head.weight")
    vocab_n = raw.get("draft_vocab_size") or tensors["lm_head.weight"].shape[0]
    layers = raw.get("eagle_aux_hidden_state_layer_ids")
    sglang = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if not layers and sglang:  # SGLang counts a feature as the output of the layer before
        layers = [int(i) + 1 for i in sglang]
    # layer N (one past the last) is the last layer's output, before the final norm
    if layers and not all(0 <= int(x) <= tc.num_layers for x in layers):
        raise InvalidRequestError(
            f"the EAGLE-3 head reads features of layers {list(layers)}; the target has "
            f"{tc.num_layers}: it was trained for another target"
        )
    head = Eagle3Head(tc, int(vocab_n), tuple(int(x) for x in layers) if layers else None)
    # as vLLM 0.34 reads them: the variants from the top level, norm_before_fc from NVIDIA's
    # `eagle_config` first; a speculators config's missing norm_before_residual as true
    flags = {k: bool(raw.get(k, False)) for k in head.variant}
    nested = raw.get("eagle_config") or {}
    flags["norm_before_fc"] = bool(nested.get("norm_before_fc", flags["norm_before_fc"]))
    if "norm_before_residual" not in raw:
        flags["norm_before_residual"] = "speculators_model_type" in raw
    try:
        head.set_variant(**flags)
    except ValueError as e:
        raise InvalidRequestError(f"the EAGLE-3 checkpoint's config: {e}") from None
    vocab_ids = None
    if d2t is not None:
        vocab_ids = torch.arange(d2t.numel()) + d2t.long()
        if t2d is not None and int(t2d.sum()) != vocab_ids.numel():
            raise InvalidRequestError("the checkpoint's d2t and t2d disagree")
    elif vocab_n != tc.vocab_size:
        raise InvalidRequestError("a reduced-vocabulary EAGLE-3 checkpoint needs d2t")
    _load_layer_weights(head, tensors)
    return head, vocab_ids


def _load_layer_weights(head: EagleHead, tensors: dict[str, torch.Tensor]) -> None:
    """Fill the fused projections from unfused names; every parameter must be covered."""
    params = dict(head.named_parameters())
    cfg = head.config
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    fused = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", q),
        "v_proj": ("qkv_proj", q + kv),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", cfg.intermediate_size),
    }
    filled: dict[str, int] = {}
    # a Llama layer's checkpoint on a target whose layers have q/k/v biases (Qwen2): none is a
    # zero bias; and a zero o_proj bias (vLLM's `attention_bias` layout) is none
    for name, p in params.items():
        if name.endswith("qkv_proj.bias") and not any(
            name.replace("qkv_proj", part) in tensors for part in ("q_proj", "k_proj", "v_proj")
        ):
            p.data.zero_()
            filled[name] = p.shape[0]
    for name, t in tensors.items():
        target, offset = name, None
        for part, (into, off) in fused.items():
            if f".{part}." in name:
                target, offset = name.replace(part, into), off
        if target not in params and name.endswith("o_proj.bias") and not t.any():
            continue
        if target not in params:
            raise InvalidRequestError(f"unexpected tensor {name!r} in the head checkpoint")
        p = params[target].data
        if offset is not None and offset + t.shape[0] > p.shape[0]:
            raise InvalidRequestError(
                f"tensor {name!r} has shape {tuple(t.shape)}: more rows than the layer its "
                "config.json describes holds (heads, head size)"
            )
        dst = p if offset is None else p.narrow(0, offset, t.shape[0])
        if dst.shape != t.shape:
            raise InvalidRequestError(
                f"tensor {name!r} has shape {tuple(t.shape)}, expected {tuple(dst.shape)}"
            )
        dst.copy_(t)
        filled[target] = filled.get(target, 0) + t.shape[0]
    for name, p in params.items():
        if filled.get(name, 0) != p.shape[0]:
            raise InvalidRequestError(f"the head checkpoint lacks (part of) {name!r}")


def default_head_path(kind: str, engine: LLMEngine) -> Path:
    """The head shipped for the default target, or one `models pull` built for a pulled one."""
    from specdecode.models.loader import DEFAULT_MODEL
    from specdecode.models.registry import default_head

    shipped = ASSETS / f"smollm2-135m-{kind}"
    if engine.model_path.name.startswith(DEFAULT_MODEL) and shipped.is_dir():
        return shipped
    built = default_head(engine.model_path, kind)
    if built is not None:
        return built
    raise InvalidRequestError(
        f"method {kind!r} needs a head directory ('model' in the speculative config, or "
        f"--speculative-draft-model-path); heads are shipped for the default target and "
        f"built by `specdecode models pull` for the pulled ones (`specdecode models list`)"
    )


def resolve_head(model: str | None, kind: str, engine: LLMEngine) -> Path:
    """A head directory, a head `models pull` builds (by name), or the default for the target."""
    from specdecode.models.registry import RECIPES, built_head

    if not model:
        return default_head_path(kind, engine)
    if model in RECIPES:
        return built_head(model)
    return Path(model).expanduser()


def head_weight_dtype(config: SpeculativeConfig, target_dtype: torch.dtype) -> torch.dtype:
    """Storage dtype of a head's packed weights. The head only proposes, so its precision never
    touches exactness: `draft_dtype` when given; otherwise bf16 where the kernels run bf16 at
    full speed (AVX-512: half the bytes of a draft step, which streams its weights like a
    decode step) or the target is bf16 already, else fp32 (on AVX2 the bf16 kernel's
    conversions ate the gain, measured)."""
    from specdecode import kernels
    from specdecode.engine.engine import resolve_dtype

    if config.draft_dtype in ("int8", "int4"):  # (checked runnable: _check_head_dtype)
        return torch.int8 if config.draft_dtype == "int8" else torch.int4
    if config.draft_dtype:  # float32 or bfloat16 (_check_head_dtype)
        return resolve_dtype(config.draft_dtype)
    if target_dtype == torch.bfloat16 or kernels.cpu_isa() == "avx512":
        return torch.bfloat16
    return torch.float32


def _check_head_dtype(config: SpeculativeConfig, engine: LLMEngine) -> None:
    """A head's `draft_dtype` is the dtype of its weights in the CPU kernels (float32,
    bfloat16, int8, int4): refused where those do not run it, as a draft model's is, rather
    than dropped."""
    from specdecode.config import QUANTIZED_DRAFT_DTYPES
    from specdecode.drafters.draft_model import kernels_ready, quantized_draft_dtype

    if config.draft_dtype is None:
        return
    if config.draft_dtype in QUANTIZED_DRAFT_DTYPES:
        quantized_draft_dtype(config, engine)  # (its own clear errors)
        return
    if config.draft_dtype not in ("float32", "bfloat16"):
        raise InvalidRequestError(
            f"a head's draft_dtype is float32, bfloat16, int8 or int4 (got {config.draft_dtype})"
        )
    if not kernels_ready(engine):
        raise InvalidRequestError(
            "a head's draft_dtype sets its weights in the CPU kernels: it needs them (an x86 "
            "CPU with AVX-512 or AVX2, --kernels auto, the model on the CPU)"
        )


def engine_token_map(config: SpeculativeConfig, engine: LLMEngine) -> torch.Tensor | None:
    """The speculative config's token map (target ids, the end of sequence ids added), on the
    target's device; None without one."""
    from specdecode.models.token_map import load_token_map

    if config.token_map is None:
        return None
    ids = load_token_map(
        config.token_map,
        engine.model_config.vocab_size,
        engine.config.allow_pickle,
        always=tuple(sorted(engine._eos_ids())),
    )
    return ids.to(engine.model.norm.weight.device)


def load_head_for(config: SpeculativeConfig, engine: LLMEngine, kind: str):
    path = resolve_head(config.model, kind, engine)
    if not path.is_dir():
        what = "is a file, not a head directory" if path.exists() else "does not exist"
        raise InvalidRequestError(f"head directory {path} {what}")
    found = head_kind(path)
    if found != kind:
        if found is None and (path / "config.json").is_file():
            _refuse_draft(path, _read_config(path))
        what = (
            f"an {found}"
            if found in ("eagle", "eagle3")
            else f"a {found}"
            if found
            else ("an unrecognised")
        )
        raise InvalidRequestError(f"{path} holds {what} head, not {kind!r}")
    _check_head_dtype(config, engine)
    token_map = engine_token_map(config, engine)
    head = load_head(path, engine.model, engine.config.allow_pickle, token_map)
    if engine.config.kernels == "auto":
        dtype = head_weight_dtype(config, engine.model.norm.weight.dtype)
        if kind == "medusa":
            head.proj.pack(dtype)
        else:
            head.accelerate(dtype)
    return head
