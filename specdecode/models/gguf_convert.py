"""GGUF -> Hugging Face-style safetensors directory (weights dequantized to fp32).

Tensor names and metadata keys follow the GGUF spec (ggml-org/ggml docs/gguf.md). llama.cpp's
converter interleaves the rows of q/k projections for the `llama` architecture (its rotary
implementation pairs adjacent dimensions); we undo that so the weights match the half-split
rotation of the original checkpoint. `qwen2`/`qwen3` use the half-split form already.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from specdecode.errors import CorruptModelError, UnsupportedModelError

_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def hf_tensor_name(gguf_name: str) -> str | None:
    base, _, kind = gguf_name.rpartition(".")
    if base == "token_embd":
        return f"model.embed_tokens.{kind}"
    if base == "output_norm":
        return f"model.norm.{kind}"
    if base == "output":
        return f"lm_head.{kind}"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{kind}"
    return None


def unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's q/k row interleave: [n_head, d/2, 2] -> [n_head, 2, d/2]."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def gguf_config(reader) -> dict:
    arch = _field(reader, "general.architecture")
    if arch not in _ARCHITECTURES:
        raise UnsupportedModelError(
            f"unsupported GGUF architecture {arch!r}; supported: {', '.join(_ARCHITECTURES)}"
        )
    names = {t.name for t in reader.tensors}

    def get(key: str, default=None):
        value = _field(reader, f"{arch}.{key}", default)
        if value is None:
            raise CorruptModelError(f"GGUF metadata lacks {arch}.{key}")
        return value

    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    tokens = _field(reader, "tokenizer.ggml.tokens") or []
    cfg = {
        "architectures": [_ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": int(_field(reader, f"{arch}.vocab_size", len(tokens))),
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": int(get("attention.key_length", hidden // heads)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length")),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
    }
    if arch == "qwen2":
        cfg["attention_bias"] = True
    if "rope_freqs.weight" in names:  # Llama 3.1+: per-frequency factors, not read here
        raise UnsupportedModelError(
            "this GGUF scales RoPE per frequency (rope_freqs: Llama 3.1 and later), which the "
            "converter does not read; load the Hugging Face checkpoint instead"
        )
    scaling = _field(reader, f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        if scaling != "linear":
            raise UnsupportedModelError(f"unsupported GGUF RoPE scaling {scaling!r}")
        factor = float(get("rope.scaling.factor"))
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": factor}
    return cfg


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Write config.json, model.safetensors and the tokenizer files of `gguf_path` to `out_dir`."""
    import gguf

    try:
        reader = gguf.GGUFReader(str(gguf_path))
    except Exception as e:  # noqa: BLE001 - the reader raises assorted errors on bad files
        raise CorruptModelError(f"{gguf_path} is not a readable GGUF file: {e}") from e
    cfg = gguf_config(reader)
    out_dir.mkdir(parents=True, exist_ok=True)
    shard: dict[str, torch.Tensor] = {}
    shard_bytes, files = 0, []
    for t in reader.tensors:
        name = hf_tensor_name(t.name)
        if name is None:
            continue
        shard[name] = _dequantize(t, name, cfg)
        shard_bytes += shard[name].numel() * 4
        if shard_bytes >= _SHARD_BYTES:
            files.append(_write_shard(shard, out_dir, len(files)))
            shard, shard_bytes = {}, 0
    if shard:
        files.append(_write_shard(shard, out_dir, len(files)))
    _name_shards_like_hf(files, out_dir)
    _save_tokenizer(gguf_path, out_dir)
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2))


_SHARD_BYTES = 2 * 2**30  # bounds the memory a conversion holds at once


def _dequantize(t, name: str, cfg: dict) -> torch.Tensor:
    import gguf

    w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
    w = w.reshape([int(d) for d in reversed(t.shape)])
    if cfg["model_type"] == "llama":  # undo llama.cpp's q/k row interleave
        if name.endswith(("q_proj.weight", "q_proj.bias")):
            w = unpermute_rows(w, cfg["num_attention_heads"])
        elif name.endswith(("k_proj.weight", "k_proj.bias")):
            w = unpermute_rows(w, cfg["num_key_value_heads"])
    return torch.from_numpy(np.array(w, dtype=np.float32, order="C"))


def _write_shard(tensors: dict[str, torch.Tensor], out_dir: Path, index: int) -> Path:
    from specdecode.models.loader import write_safetensors

    path = out_dir / f"shard-{index:05d}.safetensors"
    write_safetensors(tensors, path)
    return path


def _name_shards_like_hf(files: list[Path], out_dir: Path) -> None:
    """model.safetensors, or model-0000i-of-0000n.safetensors plus the index transformers reads."""
    from safetensors import safe_open

    if len(files) == 1:
        files[0].rename(out_dir / "model.safetensors")
        return
    weight_map = {}
    for i, f in enumerate(files, start=1):
        name = f"model-{i:05d}-of-{len(files):05d}.safetensors"
        with safe_open(str(f), framework="pt") as st:
            weight_map.update({k: name for k in st.keys()})
        f.rename(out_dir / name)
    index = {"metadata": {}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))


def _save_tokenizer(gguf_path: Path, out_dir: Path) -> None:
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except Exception as e:  # noqa: BLE001
        raise CorruptModelError(f"{gguf_path}: cannot build its tokenizer ({e})") from e
    tok.save_pretrained(str(out_dir))
