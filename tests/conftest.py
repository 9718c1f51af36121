"""Shared fixtures: tiny random models of every family, saved as HF directories, and the real
default model (SmolLM2-135M-Instruct) loaded once per session."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

TINY = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
)

FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "llama3-rope": (
        "LlamaConfig",
        "LlamaForCausalLM",
        {
            "rope_theta": 500000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
    ),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": True}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 32}),
}


def make_tiny_hf(family: str, out: Path, seed: int = 0, logit_scale: float = 1.0):
    """Save a random tiny transformers model of `family` to `out`; return the HF model.
    `logit_scale` sharpens the output distribution (a random model's is nearly flat)."""
    import transformers

    cfg_name, model_name, extra = FAMILIES[family]
    cfg = getattr(transformers, cfg_name)(**TINY, **extra)
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(cfg).eval()
    # Random (not default-initialised) norms, so a wrong norm implementation shows.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0, 0.1)
        model.get_output_embeddings().weight.mul_(logit_scale)
    model.save_pretrained(out, safe_serialization=True)
    return model


@pytest.fixture(scope="session", params=list(FAMILIES))
def tiny_family(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"tiny-{request.param}")
    hf = make_tiny_hf(request.param, out)
    return request.param, out, hf


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiny-llama")
    make_tiny_hf("llama", out)
    _write_byte_tokenizer(out)
    return out


@pytest.fixture(scope="session")
def sharp_llama_dir(tmp_path_factory) -> Path:
    """A tiny model with peaked next-token distributions: drafts get accepted at temperature 1."""
    out = tmp_path_factory.mktemp("sharp-llama")
    make_tiny_hf("llama", out, seed=1, logit_scale=6.0)
    _write_byte_tokenizer(out)
    return out


def _write_byte_tokenizer(out: Path) -> None:
    """A 128-symbol character-level tokenizer (ASCII), so engine tests can use text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {chr(i) if i >= 32 else f"<{i}>": i for i in range(128)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<0>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": "<2>",
                "bos_token": "<1>",
                "unk_token": "<0>",
                "chat_template": "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}"
                "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}",
            }
        )
    )


@pytest.fixture(scope="session")
def smol():
    """The real default model, fp32, loaded once (converted from GGUF on first use)."""
    from specdecode.models.loader import load_model, load_tokenizer

    loaded = load_model(None, dtype=torch.float32)
    return loaded, load_tokenizer(loaded.path)
