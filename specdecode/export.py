"""`specdecode export`: write a trained head in the layout another engine loads.

- eagle3: vllm = LlamaForCausalLMEagle3 with `midlayer.*`, d2t/t2d; sglang = the same with the
  aux layer ids counted as layer outputs; speculators = Eagle3Speculator (`layers.0.*`).
- eagle (EAGLE-1): vllm = EagleLlamaForCausalLM (no fc bias); sglang = LlamaForCausalLMEagle
  (whose fc always has a bias: a zero one is written for heads without).
- medusa: vllm = MedusaModel (`blocks.*`, the target's LM head as `original_lm_head`), over the
  target's whole vocabulary (vLLM 0.32 cannot load a `token_map`; one is read, not written).

Layer-id conventions differ: we (and vLLM) name the EAGLE-3 features by the layer they *enter*;
SGLang names them by the layer whose *output* they are (id - 1). vLLM's speculators path
defaults `norm_before_residual` to true, so it is always written. Formats after: SafeAILab EAGLE
(github.com/SafeAILab/EAGLE), vLLM (`llama_eagle3.py`, `medusa.py`), SGLang (`llama_eagle3.py`),
speculators (github.com/vllm-project/speculators).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from specdecode.errors import InvalidRequestError
from specdecode.models.head_io import _unfused, load_head
from specdecode.models.heads import (
    EAGLE3_VARIANTS,
    Eagle3Head,
    EagleHead,
    MedusaHeads,
    vocab_maps,
)
from specdecode.models.llama import LlamaModel

FORMATS = ("vllm", "sglang", "speculators")


def _llama_keys(c) -> dict:
    # the head's layer is a Llama layer whatever the target's family
    return {**c.hf_dict(num_layers=1), "model_type": "llama", "torch_dtype": "bfloat16"}


def _llama_layer(tensors: dict[str, torch.Tensor], fmt: str, hidden: int) -> None:
    """Our head's layer follows the target's family; the engines load a Llama layer. Qwen3's
    q/k norms have no place there; Qwen2's q/k/v biases load in vLLM (`attention_bias` also
    gives o_proj a bias: written as zeros, the same function) but SGLang's EAGLE layers have
    none and would drop them without a word."""
    if any(k.endswith(("self_attn.q_norm.weight", "self_attn.k_norm.weight")) for k in tensors):
        raise InvalidRequestError(
            "this head's layer has Qwen3's q/k norms, which the Llama layer of vLLM's and "
            "SGLang's EAGLE heads does not have; it cannot be exported"
        )
    biased = [k for k in tensors if k.endswith("self_attn.q_proj.bias")]
    if biased and fmt == "sglang":
        raise InvalidRequestError(
            "this head's layer has q/k/v biases (a Qwen2 target's), which SGLang's EAGLE layer "
            "does not load; export it with --format vllm"
        )
    for k in biased:
        o = k.replace("q_proj.bias", "o_proj.bias")
        tensors.setdefault(o, torch.zeros(hidden))


_COPIED = ("training.json",)  # from the head, where it has them
# what an export is known by: the only folder `export` replaces is one it wrote (a trained or
# downloaded head has the same config.json and model.safetensors)
MARK = "specdecode_export.json"
# An EAGLE-1 head's draft vocabulary for SGLang (its --speculative-token-map, FR-Spec): the
# layout has no field for one, and SGLang reads a map with torch.load alone, so it is the one
# pickle file written (a tensor of token ids; this project reads it only with --allow-pickle).
TOKEN_MAP = "token_map.pt"
_WRITTEN = {"config.json", "model.safetensors", *_COPIED, MARK, TOKEN_MAP}


def check_out(head: Path, out: Path) -> None:
    """Before anything is written: the export must not land on the head it reads, nor on a
    folder's other files or a model it did not write (a previous export there is replaced)."""
    if not head.is_dir():
        raise InvalidRequestError(f"head {str(head)!r} is not a directory")
    if out.exists() and out.resolve() == head.resolve():
        raise InvalidRequestError(
            f"--out {str(out)!r} is the head itself; the export would overwrite it"
        )
    names = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    others = [n for n in names if n not in _WRITTEN]
    if others:
        raise InvalidRequestError(
            f"--out {str(out)!r} holds other files ({', '.join(others[:3])}); name an empty or "
            "new folder"
        )
    if names and MARK not in names:
        raise InvalidRequestError(
            f"--out {str(out)!r} holds a model that `export` did not write (a head, or an "
            "export from before exports were marked); name an empty or new folder, or remove it"
        )


def export_head(
    head_dir: Path,
    target: LlamaModel,
    fmt: str,
    out: Path,
    target_name: str | None = None,
    allow_pickle: bool = False,
) -> dict:
    """Write `head_dir` (any layout `load_head` reads) as `fmt` into `out`; return the config."""
    if fmt not in FORMATS:
        raise InvalidRequestError(f"unknown export format {fmt!r}; choose from {FORMATS}")
    check_out(Path(head_dir), out)
    head = load_head(head_dir, target, allow_pickle)
    c = target.config
    if isinstance(head, Eagle3Head):
        tensors, config = _eagle3(head, target, fmt, target_name)
    elif isinstance(head, EagleHead):
        tensors, config = _eagle(head, fmt)
    elif isinstance(head, MedusaHeads):
        tensors, config = _medusa(head, target, fmt)
    else:  # pragma: no cover
        raise InvalidRequestError("unknown head")
    config.setdefault("vocab_size", c.vocab_size)
    from specdecode.models.loader import write_safetensors

    out.mkdir(parents=True, exist_ok=True)
    for name in _WRITTEN - {MARK}:  # a previous export's files: none of them outlives this one
        (out / name).unlink(missing_ok=True)
    # the mark first: an export that fails halfway leaves a folder the next one replaces
    vocab = None if head.vocab_ids is None else int(head.vocab_ids.numel())
    kind = getattr(head, "kind", "medusa")
    mark = {"written_by": "specdecode export", "format": fmt, "kind": kind, "draft_vocab": vocab}
    (out / MARK).write_text(json.dumps(mark, indent=2))
    write_safetensors(
        {
            k: (v.to(torch.bfloat16) if v.is_floating_point() else v).contiguous()
            for k, v in tensors.items()
        },
        out / "model.safetensors",
    )
    (out / "config.json").write_text(json.dumps(config, indent=2))
    # (EAGLE-1 only: an EAGLE-3 head, an EagleHead too, carries its vocabulary as d2t)
    if fmt == "sglang" and kind == "eagle" and head.vocab_ids is not None:
        torch.save(head.vocab_ids.detach().cpu().long().contiguous(), out / TOKEN_MAP)
    for f in _COPIED:
        if (Path(head_dir) / f).is_file():
            shutil.copy(Path(head_dir) / f, out / f)
    return config


def _eagle3(head: Eagle3Head, target: LlamaModel, fmt: str, target_name: str | None):
    c = target.config
    tensors = _unfused(head, head.config)
    _llama_layer(tensors, fmt, c.hidden_size)
    n_draft = head.lm_head.out_features
    if n_draft < c.vocab_size:
        tensors["d2t"], tensors["t2d"] = vocab_maps(head.vocab_ids, c.vocab_size)
    elif head.vocab_ids is not None:  # the whole vocabulary, in some order: the target's order
        # (vLLM has no draft-to-target map for a full-size draft vocabulary and refuses d2t)
        rows = torch.empty_like(tensors["lm_head.weight"])
        rows[head.vocab_ids.cpu()] = tensors["lm_head.weight"]
        tensors["lm_head.weight"] = rows
    aux = list(head.aux_layers)
    if fmt == "speculators":
        tensors["embed_tokens.weight"] = target.embed_tokens.weight.detach()
        config = {
            "architectures": ["Eagle3Speculator"],
            "speculators_model_type": "eagle3",
            # vLLM sizes fc by num_aux_hidden_states (3 unless said), not by the layer ids
            "transformer_layer_config": {
                **_llama_keys(head.config),
                "num_aux_hidden_states": len(aux),
            },
            "draft_vocab_size": n_draft,
            **head.variant,  # norm_before_residual always: vLLM reads a missing one as true
            "target_hidden_size": None,
            "eagle_aux_hidden_state_layer_ids": aux,
            "speculators_config": {
                "algorithm": "eagle3",
                "proposal_methods": [
                    {
                        "proposal_type": "greedy",
                        "speculative_tokens": 5,
                        "verifier_accept_k": 1,
                        "accept_tolerance": 0.0,
                    }
                ],
                "default_proposal_method": "greedy",
                "verifier": {
                    "name_or_path": target_name,
                    "architectures": [c.hf_architecture],
                },
            },
        }
        return tensors, config
    if head.norm_before_residual and fmt == "sglang":  # (SGLang 0.5.23 reads the other three)
        raise InvalidRequestError(
            "this head normalises before the residual (speculators' norm_before_residual), "
            "which SGLang's EAGLE-3 layer does not do; export it with --format vllm or "
            "--format speculators"
        )
    tensors = {k.replace("layers.0.", "midlayer."): v for k, v in tensors.items()}
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        **_llama_keys(head.config),
        "draft_vocab_size": n_draft,
    }
    if fmt == "vllm":
        config["eagle_aux_hidden_state_layer_ids"] = aux  # the layers they enter
        config["num_aux_hidden_states"] = len(aux)  # (what sizes vLLM's fc: 3 unless said)
        config.update(head.variant)  # vLLM's llama_eagle3 reads each flag from the config
    else:  # SGLang counts a feature as the output of the layer before
        if c.num_layers in aux:  # (vLLM captures the last layer's output; SGLang does not)
            raise InvalidRequestError(
                f"this head reads the last layer's output (layer id {c.num_layers}), which "
                "SGLang does not capture (it takes features where they enter a layer); export "
                "it with --format vllm or --format speculators"
            )
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in aux]}
        config.update({k: v for k, v in head.variant.items() if v})  # (read by 0.5.23)
    return tensors, config


def check_format(kind: str | None, fmt: str) -> None:
    """The formats that carry a kind of head (checked before the target loads, and again
    on the loaded head)."""
    if kind == "eagle" and fmt == "speculators":
        raise InvalidRequestError(
            "vLLM's speculators format carries EAGLE-3 heads; export an EAGLE-1 head with "
            "--format vllm or sglang"
        )
    if kind == "medusa" and fmt != "vllm":
        raise InvalidRequestError("Medusa heads export to vLLM only (--format vllm)")


def _eagle(head: EagleHead, fmt: str):
    check_format("eagle", fmt)
    has_bias = getattr(head.fc, "bias", None) is not None
    if fmt == "vllm" and has_bias:
        raise InvalidRequestError(
            "vLLM's EAGLE-1 loader has no fc bias and this head has one; use --format sglang"
        )
    tensors = _unfused(head, head.config)
    _llama_layer(tensors, fmt, head.config.hidden_size)
    arch = "EagleLlamaForCausalLM" if fmt == "vllm" else "LlamaForCausalLMEagle"
    if fmt == "sglang" and not has_bias:  # SGLang's fc always has a bias: a zero one here
        tensors["fc.bias"] = torch.zeros(head.config.hidden_size)
    # no "bias" key: SGLang's and vLLM's Llama layers read it as `attention_bias` (q/k/v/o
    # biases this head does not have); SGLang's fc takes its bias from the tensor
    config = {"architectures": [arch], **_llama_keys(head.config)}
    return tensors, config


def _medusa(head: MedusaHeads, target: LlamaModel, fmt: str):
    check_format("medusa", fmt)
    c = target.config
    tensors = {}
    for i, blocks in enumerate(head.medusa_head):
        for j, block in enumerate(blocks):
            tensors[f"blocks.{i}.layers.{j}.weight"] = block.linear.weight.detach()
            tensors[f"blocks.{i}.layers.{j}.bias"] = block.linear.bias.detach()
    # Over the target's whole vocabulary: vLLM 0.32 (the last release with Medusa) refuses a
    # `token_map` checkpoint, as its loader's weight check counts the map it builds as never
    # loaded (found serving an export there). A draft vocabulary's rows are put at their target
    # ids; vLLM then drafts over every token (lossless; drafts can differ, see export_notes).
    vocab = head.vocab_ids
    if head.own_projections is not None:
        for i, w in enumerate(head.own_projections):
            if vocab is not None:  # rows outside the draft vocabulary: zero (logit 0)
                whole = w.new_zeros(c.vocab_size, w.shape[1])
                whole[vocab.to(w.device)] = w
                w = whole
            tensors[f"lm_heads.{i}.weight"] = w
        original = False
    else:  # ours project with the target's LM head: `original_lm_head`
        tensors["lm_head.weight"] = target.lm_head.weight.detach()
        original = True
    config = {
        "architectures": ["MedusaModel"],
        "model_type": "medusa",
        "hidden_size": c.hidden_size,
        "vocab_size": c.vocab_size,
        "num_heads": head.num_heads,
        "num_hidden_layers": len(head.medusa_head[0]),
        "medusa_fc_bias": True,
        "original_lm_head": original,
    }
    return tensors, config


def export_notes(
    fmt: str,
    kind: str,
    draft_vocab: int | None = None,
    remote: bool = True,
    config: dict | None = None,
) -> list[str]:
    """What the serving side should know about an export (printed by the CLI)."""
    notes = []
    config = config or {}
    ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    flags = [k for k in EAGLE3_VARIANTS if config.get(k)]  # (norm_before_residual: refused)
    if fmt == "sglang" and kind == "eagle3" and (flags or (ids and (len(ids) != 3 or -1 in ids))):
        notes.append(
            "serve it with SGLang 0.5.23 or later (the release it was checked against): 0.5.5 "
            "builds fc for 3 features, cannot capture the embeddings (layer id -1) and reads "
            "none of speculators' variants"
        )
    if kind == "medusa":
        notes.append("vLLM 0.32 is the last release with Medusa (0.33 removed it); SGLang has none")
        if draft_vocab:
            notes.append(
                f"this Medusa head drafts over {draft_vocab} tokens here; vLLM 0.32 cannot load "
                "a draft vocabulary (token_map), so it is written over the target's whole "
                "vocabulary and vLLM drafts over all of it (still lossless; its drafts can differ)"
            )
    if kind == "eagle" and draft_vocab and fmt == "sglang":
        notes.append(
            f"this EAGLE-1 head drafts over {draft_vocab} tokens here; {TOKEN_MAP} holds them "
            "for SGLang's --speculative-token-map (in the command above), so SGLang drafts "
            "over the same tokens"
        )
    elif kind == "eagle" and draft_vocab:
        notes.append(
            f"this EAGLE-1 head drafts over {draft_vocab} tokens here; "
            "EAGLE-1 layouts have no field for a draft vocabulary, so vLLM drafts it over the "
            "target's whole LM head (still lossless; its drafts can differ); `--format sglang` "
            "keeps the vocabulary (a token map)"
        )
    if fmt == "speculators" and not remote:
        notes.append(
            "the verifier named in config.json is a local directory: vLLM serves a speculators "
            "checkpoint alone only when its verifier is a Hub id (--target-name sets one), so "
            "the command above names the target itself"
        )
    return notes


def serve_command(
    fmt: str,
    kind: str,
    target: str,
    head_dir: str,
    num_heads: int | None = None,
    remote: bool = True,
    token_map: bool = False,
) -> str:
    """The command that serves an exported head (printed by the CLI, listed in the README).
    Medusa drafts as many tokens as it has heads: vLLM sets the config's head count to
    `num_speculative_tokens` (MedusaConfig.num_lookahead_tokens), so any other number builds
    heads the checkpoint does not have, or leaves some unused."""
    if fmt == "sglang":
        algo = {"eagle3": "EAGLE3", "eagle": "EAGLE"}[kind]
        return (
            f"python -m sglang.launch_server --model-path {target} --speculative-algorithm {algo} "
            f"--speculative-draft-model-path {head_dir} --speculative-num-steps 5 "
            "--speculative-eagle-topk 4 --speculative-num-draft-tokens 8"
            + (f" --speculative-token-map {head_dir}/{TOKEN_MAP}" if token_map else "")
        )
    if fmt == "speculators" and remote:
        return f"vllm serve {head_dir}"  # the target comes from speculators_config
    k = num_heads if kind == "medusa" and num_heads else 5
    return (
        f"vllm serve {target} --speculative-config "
        f'\'{{"method": "{kind}", "model": "{head_dir}", "num_speculative_tokens": {k}}}\''
    )
