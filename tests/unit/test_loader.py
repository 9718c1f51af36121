"""Model loading: sharded safetensors, GGUF conversion, and every kind of bad input."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import make_tiny_hf
from helpers import Runner

from specdecode.errors import (
    CorruptModelError,
    ModelNotFoundError,
    UnsupportedModelError,
)
from specdecode.models.gguf_convert import convert_gguf, unpermute_rows
from specdecode.models.loader import load_model


def logits_of(model, ids):
    r = Runner(model)
    return r.feed([r.new_seq()], [ids])[0]


def test_sharded_checkpoint_loads_identically(tmp_path):
    hf = make_tiny_hf("qwen2", tmp_path / "one")
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 1
    ids = list(range(1, 12))
    a = logits_of(load_model(tmp_path / "one").model, ids)
    b = logits_of(load_model(tmp_path / "sharded").model, ids)
    assert torch.equal(a, b)


def test_pickle_refused_unless_allowed(tmp_path):
    hf = make_tiny_hf("llama", tmp_path / "m")
    for f in (tmp_path / "m").glob("*.safetensors"):
        f.unlink()
    torch.save(hf.state_dict(), tmp_path / "m" / "pytorch_model.bin")
    with pytest.raises(UnsupportedModelError, match="pickle"):
        load_model(tmp_path / "m")
    ids = list(range(1, 9))
    want = hf(torch.tensor([ids])).logits[0].detach()
    got = logits_of(load_model(tmp_path / "m", allow_pickle=True).model, ids)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_bad_inputs_raise_clear_errors(tmp_path):
    with pytest.raises(ModelNotFoundError, match="not found"):
        load_model(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFoundError, match="config.json"):
        load_model(tmp_path / "empty")
    make_tiny_hf("llama", tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    shutil.copytree(tmp_path / "m", tmp_path / "gpt2")
    (tmp_path / "gpt2" / "config.json").write_text(
        json.dumps({**cfg, "architectures": ["GPT2LMHeadModel"]})
    )
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        load_model(tmp_path / "gpt2")
    shutil.copytree(tmp_path / "m", tmp_path / "corrupt")
    (tmp_path / "corrupt" / "model.safetensors").write_bytes(b"\x00" * 100)
    with pytest.raises(CorruptModelError):
        load_model(tmp_path / "corrupt")
    (tmp_path / "x.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(CorruptModelError, match="GGUF"):
        load_model(tmp_path / "x.gguf")


def test_unpermute_inverts_llama_cpp_interleave():
    w = np.arange(4 * 8 * 3, dtype=np.float32).reshape(4 * 8, 3)  # 4 heads of dim 8
    n_head = 4
    permuted = w.reshape(n_head, 2, 4, 3).swapaxes(1, 2).reshape(w.shape)  # llama.cpp's permute
    assert np.array_equal(unpermute_rows(permuted, n_head), w)


def _write_gguf(hf, path, extra=None):
    """Fabricate a llama GGUF from a transformers model, the way llama.cpp's converter lays it out
    (q/k rows interleaved, F32 tensors). `extra(writer)` adds more."""
    import gguf

    cfg = hf.config
    w = gguf.GGUFWriter(str(path), "llama")
    if extra is not None:
        extra(w)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(cfg.vocab_size)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    names = {"embed_tokens": "token_embd", "norm": "output_norm"}
    layer = {
        "input_layernorm": "attn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "post_attention_layernorm": "ffn_norm",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    for name, t in hf.state_dict().items():
        a = t.numpy().astype(np.float32)
        parts = name.split(".")
        if name == "lm_head.weight":
            g = "output.weight"
        elif parts[1] in names:
            g = f"{names[parts[1]]}.weight"
        else:
            key = ".".join(parts[3:-1])
            g = f"blk.{parts[2]}.{layer[key]}.weight"
            heads = {"attn_q": cfg.num_attention_heads, "attn_k": cfg.num_key_value_heads}
            if layer[key] in heads:
                n = heads[layer[key]]
                a = a.reshape(n, 2, a.shape[0] // n // 2, -1).swapaxes(1, 2).reshape(a.shape)
        w.add_tensor(g, np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_conversion_matches_the_original(tmp_path, monkeypatch):
    monkeypatch.setattr("specdecode.models.gguf_convert._save_tokenizer", lambda src, out: None)
    hf = make_tiny_hf("llama", tmp_path / "hf")
    _write_gguf(hf, tmp_path / "tiny.gguf")
    convert_gguf(tmp_path / "tiny.gguf", tmp_path / "converted")
    ids = list(range(3, 19))
    got = logits_of(load_model(tmp_path / "converted").model, ids)
    want = hf(torch.tensor([ids])).logits[0].detach()
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_cuda_under_torchrun_is_the_ranks_own_gpu(monkeypatch):
    from specdecode.engine.engine import resolve_device

    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)  # (a CUDA machine's answers)
    monkeypatch.setattr("torch.cuda.device_count", lambda: 4)
    assert str(resolve_device("cuda")) == "cuda:3"
    assert str(resolve_device("cuda:0")) == "cuda:0" and str(resolve_device("cpu")) == "cpu"
    monkeypatch.setattr("torch.cuda.device_count", lambda: 1)  # one visible GPU per rank
    assert str(resolve_device("cuda")) == "cuda"
    monkeypatch.delenv("LOCAL_RANK")
    assert str(resolve_device("cuda")) == "cuda"


def test_gguf_rope_scaling_is_read_or_refused(tmp_path):
    """Linear RoPE scaling is carried into the converted config; Llama 3.1's per-frequency
    factors (a rope_freqs tensor) are refused, not silently dropped."""
    import gguf

    from specdecode.errors import UnsupportedModelError
    from specdecode.models.gguf_convert import gguf_config

    hf = make_tiny_hf("llama", tmp_path / "hf")

    def linear(w):
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(4.0)

    _write_gguf(hf, tmp_path / "linear.gguf", linear)
    cfg = gguf_config(gguf.GGUFReader(str(tmp_path / "linear.gguf")))
    assert cfg["rope_scaling"] == {"rope_type": "linear", "factor": 4.0}
    _write_gguf(
        hf, tmp_path / "l31.gguf", lambda w: w.add_tensor("rope_freqs.weight", np.ones(8, "f4"))
    )
    with pytest.raises(UnsupportedModelError, match="rope_freqs"):
        gguf_config(gguf.GGUFReader(str(tmp_path / "l31.gguf")))


def test_exported_configs_carry_rope_scaling():
    from specdecode.config import ModelConfig, RopeConfig, rope_from_hf

    for scaling in (("linear", 2.0), ("llama3", 8.0, 1.0, 4.0, 64), None):
        rope = RopeConfig(theta=5e5, scaling=scaling)
        c = ModelConfig("llama", 128, 64, 128, 2, 4, 2, 16, 1e-6, 256, False, False, False, rope)
        assert rope_from_hf(c.hf_dict(1)) == rope


def test_only_the_models_own_shards_are_read(tmp_path):
    """A repository may hold other weights beside the model's (Mistral ships its own
    `consolidated.safetensors`): the index's shards are read, or `model*` files."""
    from safetensors.torch import save_file

    hf = make_tiny_hf("llama", tmp_path / "one")
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    ids = list(range(1, 12))
    want = logits_of(load_model(tmp_path / "one").model, ids)
    other = {"layers.0.attention.wq.weight": torch.zeros(2, 2)}
    for d in ("one", "sharded"):
        save_file(other, str(tmp_path / d / "consolidated.safetensors"))
        assert torch.equal(logits_of(load_model(tmp_path / d).model, ids), want)
    shards = sorted((tmp_path / "sharded").glob("model-*.safetensors"))
    shards[-1].unlink()
    with pytest.raises(CorruptModelError, match="missing"):
        load_model(tmp_path / "sharded")
    index = tmp_path / "sharded" / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"lm_head.weight": 3}}))
    with pytest.raises(CorruptModelError, match="not a safetensors index"):
        load_model(tmp_path / "sharded")


def test_configs_the_model_cannot_honour_are_refused_or_capped(tmp_path):
    from specdecode.config import ModelConfig

    make_tiny_hf("llama", tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    for flag in ("attention_bias", "mlp_bias"):  # Llama's flags put biases on o_proj / the MLP
        with pytest.raises(UnsupportedModelError, match=flag):
            ModelConfig.from_hf({**cfg, flag: True})
    # a sliding window narrower than the context caps it (full attention agrees up to there)
    mistral = {**cfg, "architectures": ["MistralForCausalLM"], "max_position_embeddings": 256}
    assert ModelConfig.from_hf({**mistral, "sliding_window": 64}).max_position_embeddings == 64
    assert ModelConfig.from_hf({**mistral, "sliding_window": None}).max_position_embeddings == 256
    qwen = {**mistral, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 64}
    assert ModelConfig.from_hf(qwen).max_position_embeddings == 256  # not in use
    assert ModelConfig.from_hf({**qwen, "use_sliding_window": True}).max_position_embeddings == 64
    nulls = ModelConfig.from_hf({**cfg, "rms_norm_eps": None, "max_position_embeddings": None})
    assert nulls.rms_norm_eps == 1e-6 and nulls.max_position_embeddings == 2048


def test_gguf_conversions_are_shared_by_content_not_path(tmp_path, monkeypatch):
    """Two copies of one GGUF file (the package in two virtual environments) share a
    conversion; a file with other bytes gets its own; the hash is remembered per path."""
    from specdecode.models import loader

    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    calls = []

    def fake_convert(src, out):
        calls.append(src)
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text("{}")

    monkeypatch.setattr("specdecode.models.gguf_convert.convert_gguf", fake_convert)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first = tmp_path / "a" / "m.gguf"
    first.write_bytes(b"GGUF" + bytes(range(256)) * 100)
    shutil.copy(first, tmp_path / "b" / "m.gguf")
    out_a = loader.convert_gguf_cached(first)
    out_b = loader.convert_gguf_cached(tmp_path / "b" / "m.gguf")
    assert out_a == out_b and len(calls) == 1
    # under a name (the default model's, a pulled model's: its heads are found by it): its own
    # directory, hard links to the conversion there is, no second conversion
    named = loader.convert_gguf_cached(first, name="Default-Model")
    assert named.name.startswith("Default-Model-") and len(calls) == 1
    assert (named / "config.json").stat().st_ino == (out_a / "config.json").stat().st_ino
    index = json.loads((tmp_path / "cache" / "models" / "gguf-sha256.json").read_text())
    assert len(index) == 2 and len(set(index.values())) == 1
    other = tmp_path / "c.gguf"
    other.write_bytes(b"GGUF" + bytes(range(255, -1, -1)) * 100)
    assert loader.convert_gguf_cached(other) != out_a and len(calls) == 2
    (tmp_path / "b" / "m.gguf").unlink()  # gone: its entry is dropped at the next write
    (tmp_path / "d.gguf").write_bytes(b"GGUF")
    loader.convert_gguf_cached(tmp_path / "d.gguf")
    index = json.loads((tmp_path / "cache" / "models" / "gguf-sha256.json").read_text())
    assert sorted(Path(k.rsplit(":", 2)[0]).name for k in index) == ["c.gguf", "d.gguf", "m.gguf"]
    monkeypatch.setattr(loader, "CONVERT_VERSION", loader.CONVERT_VERSION + 1)
    assert loader.convert_gguf_cached(first) != out_a and len(calls) == 4
