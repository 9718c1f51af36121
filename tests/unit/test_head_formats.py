"""Checkpoint compatibility, on tiny checkpoints fabricated in each public layout: SafeAILab
EAGLE-1 and EAGLE-3, vLLM speculators, Medusa (FasterDecoding and vLLM); and `export` to vLLM,
SGLang and speculators layouts, read back."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import HEAD_TARGET_CONFIG as CFG
from helpers import OWN_HEAD_LAYER
from safetensors.torch import save_file

from specdecode.errors import InvalidRequestError
from specdecode.export import export_head
from specdecode.models.head_io import _unfused, head_kind, load_head, save_head
from specdecode.models.heads import Eagle3Head, EagleHead, MedusaHeads
from specdecode.models.llama import LlamaModel

H, V = CFG.hidden_size, CFG.vocab_size
LLAMA = dict(
    hidden_size=H,
    intermediate_size=CFG.intermediate_size,
    num_hidden_layers=1,
    num_attention_heads=CFG.num_heads,
    num_key_value_heads=CFG.num_kv_heads,
    rms_norm_eps=CFG.rms_norm_eps,
    max_position_embeddings=CFG.max_position_embeddings,
    vocab_size=V,
)


@pytest.fixture
def target():
    torch.manual_seed(0)
    return LlamaModel(CFG).eval()


def _randomise(module, seed=3):
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_((torch.randn_like(p) * 0.2).to(torch.bfloat16).float())
    return module


def _write(path, config, tensors, name="model.safetensors"):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / name))


def _eagle3(target, vocab):
    head = _randomise(Eagle3Head(CFG, vocab.numel()))
    head.attach(target.embed_tokens, vocab)
    return head.eval()


def _same_eagle(a, b):
    ids, feats = torch.randint(0, V, (1, 5)), torch.randn(1, 5, a.feature_size)
    with torch.no_grad():
        torch.testing.assert_close(a.forward_dense(ids, feats), b.forward_dense(ids, feats))
        x = torch.randn(3, H)
        torch.testing.assert_close(a.logits(x), b.logits(x))


def test_safeailab_eagle3_layout(target, tmp_path):
    vocab = torch.tensor([0, 3, 4, 10, 50, 95])
    head = _eagle3(target, vocab)
    tensors = {k.replace("layers.0.", "midlayer."): v for k, v in _unfused(head, CFG).items()}
    tensors["d2t"] = vocab - torch.arange(6)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[vocab] = True
    tensors["t2d"] = t2d
    tensors["embed_tokens.weight"] = target.embed_tokens.weight.detach()
    _write(
        tmp_path,
        {**LLAMA, "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": 6},
        tensors,
    )
    assert head_kind(tmp_path) == "eagle3"
    loaded = load_head(tmp_path, target)
    assert torch.equal(loaded.vocab_ids, vocab) and not loaded.norm_before_residual
    _same_eagle(head, loaded)


def test_broken_checkpoints_are_clear_errors(target, tmp_path):
    """A draft vocabulary out of range, repeated or of another size than the LM head, a
    config.json that is not a JSON object, and a truncated weights file: one-line errors that
    name the file, not tracebacks at draft time."""
    from specdecode.errors import CorruptModelError

    vocab = torch.tensor([0, 3, 4, 10, 50, 95])
    head = _eagle3(target, vocab)
    good = {k.replace("layers.0.", "midlayer."): v for k, v in _unfused(head, CFG).items()}
    config = {**LLAMA, "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": 6}
    for bad in (vocab + 1000, torch.tensor([0, 3, 3, 10, 50, 95]), vocab[:5]):
        d = tmp_path / f"d2t{len(list(tmp_path.iterdir()))}"
        _write(d, config, {**good, "d2t": bad - torch.arange(bad.numel())})
        with pytest.raises((CorruptModelError, InvalidRequestError)):
            load_head(d, target)
    d = tmp_path / "ok"
    _write(d, config, {**good, "d2t": vocab - torch.arange(6)})
    assert torch.equal(load_head(d, target).vocab_ids, vocab)
    (d / "config.json").write_text("[1, 2]")
    with pytest.raises(CorruptModelError, match="config"):
        load_head(d, target)
    (d / "config.json").write_text("{not json")
    with pytest.raises(CorruptModelError, match="not valid JSON"):
        load_head(d, target)
    (d / "config.json").write_text(json.dumps(config))
    weights = d / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(CorruptModelError, match="cannot be read"):
        load_head(d, target)


def _speculators_config(draft_vocab: int, **extra) -> dict:
    """A speculators EAGLE-3 config.json for the tiny target's layer shape."""
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "transformer_layer_config": {**LLAMA, "model_type": "llama"},
        "draft_vocab_size": draft_vocab,
        **extra,
        "speculators_config": {"algorithm": "eagle3", "verifier": {"name_or_path": "x"}},
    }


def test_speculators_eagle3_layout(target, tmp_path):
    vocab = torch.tensor([1, 2, 7, 60])
    head = _eagle3(target, vocab)
    head.norm_before_residual = True
    tensors = _unfused(head, CFG)
    tensors["d2t"] = vocab - torch.arange(4)
    config = _speculators_config(4)  # norm_before_residual absent: vLLM reads it as true
    _write(tmp_path, config, tensors)
    loaded = load_head(tmp_path, target)
    assert loaded.norm_before_residual
    _same_eagle(head, loaded)


@pytest.mark.parametrize(
    "flags",
    [{"norm_before_fc": True}, {"fc_norm": True, "norm_output": True}],
    ids=["norm_before_fc", "fc_norm+norm_output"],
)
def test_speculators_eagle3_variants_load_and_export(target, tmp_path, flags):
    """speculators' EAGLE-3 variants (vLLM reads them too): the norms load under speculators'
    names and compute; vLLM, speculators and SGLang exports carry them (SGLang refuses only
    norm_before_residual); both norms at once are refused."""
    vocab = torch.tensor([1, 2, 7, 60])
    head = _eagle3(target, vocab)
    head.set_variant(**flags)
    _randomise(head, seed=5)
    head.attach(target.embed_tokens, vocab)
    tensors = _unfused(head, CFG)
    assert ("input_norm.weight" in tensors) == ("norm_before_fc" in flags)
    assert ("fc_norm.1.weight" in tensors) == ("fc_norm" in flags)
    tensors["d2t"] = vocab - torch.arange(4)
    config = _speculators_config(4, norm_before_residual=False, **flags)
    _write(tmp_path / "in", config, tensors)
    loaded = load_head(tmp_path / "in", target)
    assert loaded.variant == {**dict.fromkeys(loaded.variant, False), **flags}
    _same_eagle(head, loaded)
    save_head(loaded, tmp_path / "ours", CFG, {})
    assert {k: True for k in flags}.items() <= json.loads(
        (tmp_path / "ours" / "config.json").read_text()
    ).items()
    from specdecode.export import export_notes

    for fmt in ("vllm", "speculators", "sglang"):  # (SGLang 0.5.23 reads these three)
        written = export_head(tmp_path / "ours", target, fmt, tmp_path / fmt, "org/target")
        assert all(written[k] is True for k in flags)
        _same_eagle(head, load_head(tmp_path / fmt, target))
    notes = export_notes("sglang", "eagle3", config=written)
    assert any("0.5.23" in n for n in notes)
    loaded.set_variant(norm_before_residual=True)
    save_head(loaded, tmp_path / "nbr", CFG, {})
    with pytest.raises(InvalidRequestError, match="format vllm or --format speculators"):
        export_head(tmp_path / "nbr", target, "sglang", tmp_path / "sg")
    _write(tmp_path / "both", {**config, "norm_before_fc": True, "fc_norm": True}, tensors)
    with pytest.raises(InvalidRequestError, match="exclude each other"):
        load_head(tmp_path / "both", target)
    if "norm_before_fc" in flags:  # NVIDIA's checkpoints name it under eagle_config (first)
        nvidia = {**config, "norm_before_fc": False, "eagle_config": {"norm_before_fc": True}}
        _write(tmp_path / "nvidia", nvidia, tensors)
        assert load_head(tmp_path / "nvidia", target).variant["norm_before_fc"]
    narrow = {**config, "target_hidden_size": H}
    narrow["transformer_layer_config"] = {**LLAMA, "model_type": "llama", "hidden_size": H // 2}
    _write(tmp_path / "narrow", narrow, tensors)
    with pytest.raises(InvalidRequestError, match="another width"):
        load_head(tmp_path / "narrow", target)


@pytest.mark.parametrize("bias", [True, False])
def test_safeailab_eagle1_layout(target, tmp_path, bias):
    head = _randomise(EagleHead(CFG, fc_bias=bias))
    head.attach(target.embed_tokens, target.lm_head.weight, None)
    tensors = _unfused(head, CFG)
    assert not any("input_layernorm" in k for k in tensors)  # layer 0 has none
    tensors["embed_tokens.weight"] = target.embed_tokens.weight.detach()
    _write(tmp_path, {**LLAMA, "architectures": ["LlamaForCausalLM"], "bias": bias}, tensors)
    assert head_kind(tmp_path) == "eagle"
    _same_eagle(head, load_head(tmp_path, target))


def test_pickle_checkpoints_need_permission(target, tmp_path):
    head = _randomise(EagleHead(CFG))
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "config.json").write_text(
        json.dumps({**LLAMA, "architectures": ["LlamaForCausalLM"]})
    )
    torch.save(_unfused(head, CFG), tmp_path / "pytorch_model.bin")
    with pytest.raises(InvalidRequestError, match="pickle"):
        load_head(tmp_path, target)
    head.attach(target.embed_tokens, target.lm_head.weight, None)
    _same_eagle(head, load_head(tmp_path, target, allow_pickle=True))
    # export takes the permission too (it read the head without it)
    with pytest.raises(InvalidRequestError, match="pickle"):
        export_head(tmp_path, target, "vllm", tmp_path / "out")
    export_head(tmp_path, target, "vllm", tmp_path / "out", allow_pickle=True)
    _same_eagle(head, load_head(tmp_path / "out", target))


@pytest.mark.parametrize("layout", ["fasterdecoding", "vllm"])
def test_medusa_layouts(target, tmp_path, layout):
    heads = _randomise(MedusaHeads(H, num_heads=2))
    projs = [torch.randn(V, H).to(torch.bfloat16).float() for _ in range(2)]
    tensors = {}
    for i, blocks in enumerate(heads.medusa_head):
        w, b = blocks[0].linear.weight, blocks[0].linear.bias
        if layout == "fasterdecoding":
            tensors |= {
                f"{i}.0.linear.weight": w,
                f"{i}.0.linear.bias": b,
                f"{i}.1.weight": projs[i],
            }
        else:
            tensors |= {
                f"blocks.{i}.layers.0.weight": w,
                f"blocks.{i}.layers.0.bias": b,
                f"lm_heads.{i}.weight": projs[i],
            }
    if layout == "fasterdecoding":  # its config names no sizes: the shapes are checked
        config = {"medusa_num_heads": 2, "medusa_num_layers": 1, "base_model_name_or_path": "x"}
        _write(tmp_path, config, tensors, "medusa_lm_head.safetensors")
        bad = {**tensors, "0.1.weight": projs[0][:50]}  # projects to 50 tokens, not V
        _write(tmp_path / "bad", config, bad, "medusa_lm_head.safetensors")
        with pytest.raises(InvalidRequestError, match="projects to"):
            load_head(tmp_path / "bad", target)
    else:
        config = {
            "architectures": ["MedusaModel"],
            "num_heads": 2,
            "num_hidden_layers": 1,
            "hidden_size": H,
            "vocab_size": V,
        }
        _write(tmp_path, config, tensors)
    loaded = load_head(tmp_path, target)
    x = torch.randn(3, H)
    with torch.no_grad():
        want = torch.stack([heads.medusa_head[k](x) @ projs[k].T for k in range(2)], dim=1)
        torch.testing.assert_close(loaded(x), want, atol=1e-4, rtol=1e-4)
    # its own projections are the module's (buffers): they move with it, to a device or dtype
    assert load_head(tmp_path, target).to(torch.float64).own_projections[1].dtype == torch.float64
    assert "own_proj_0" not in loaded.state_dict()  # (never saved as the head's own weights)
    # a token map (FR-Spec) keeps those rows of the head's own projections
    keep = torch.tensor([2, 5, 11, 40])
    mapped = load_head(tmp_path, target, token_map=keep)
    assert torch.equal(mapped.vocab_ids, keep)
    with torch.no_grad():
        torch.testing.assert_close(mapped(x), want[..., keep], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("fmt", ["vllm", "sglang", "speculators"])
def test_export_eagle3_reads_back(target, tmp_path, fmt):
    vocab = torch.tensor([0, 5, 9, 40, 41])
    head = _eagle3(target, vocab)
    layers = (1, 1)  # not the default ones (0, 1) of this 2-layer target: the export carries them
    assert head.aux_layers != layers
    head.aux_layers = layers
    save_head(head, tmp_path / "ours", CFG, {})
    config = export_head(tmp_path / "ours", target, fmt, tmp_path / fmt, "org/target")
    names = set(json.loads((tmp_path / fmt / "config.json").read_text()))
    assert not (tmp_path / fmt / "token_map.pt").exists()  # (its vocabulary is its d2t)
    from safetensors import safe_open

    with safe_open(str(tmp_path / fmt / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} <= keys
    if fmt == "speculators":
        assert config["speculators_config"]["verifier"]["name_or_path"] == "org/target"
        assert config["norm_before_residual"] is False
        assert "layers.0.hidden_norm.weight" in keys and "embed_tokens.weight" in keys
    else:
        assert "midlayer.hidden_norm.weight" in keys and "draft_vocab_size" in names
    if fmt == "sglang":  # SGLang counts the output of the layer before
        assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [
            i - 1 for i in head.aux_layers
        ]
    if fmt == "vllm":
        assert config["eagle_aux_hidden_state_layer_ids"] == list(head.aux_layers)
    loaded = load_head(tmp_path / fmt, target)
    assert torch.equal(loaded.vocab_ids, vocab) and loaded.aux_layers == layers
    _same_eagle(head, loaded)


def test_written_heads_and_exports_are_readable_by_others(target, tmp_path):
    """safetensors 0.8 creates files 0600; a head or an export is written with the mode the
    umask gives, as config.json is, so another user's engine (vLLM in a container) can read it."""
    import os
    import stat

    head = _eagle3(target, torch.tensor([0, 5, 9, 40, 41]))
    old = os.umask(0o022)
    try:
        save_head(head, tmp_path / "ours", CFG, {})
        export_head(tmp_path / "ours", target, "vllm", tmp_path / "vllm", "org/target")
    finally:
        os.umask(old)
    for d in ("ours", "vllm"):
        mode = stat.S_IMODE((tmp_path / d / "model.safetensors").stat().st_mode)
        assert mode == 0o644, (d, oct(mode))
        assert sorted(p.name for p in (tmp_path / d).iterdir() if "tmp" in p.name) == []


def test_export_refusals(target, tmp_path):
    head = _randomise(EagleHead(CFG, fc_bias=True))
    head.attach(target.embed_tokens, target.lm_head.weight, None)
    save_head(head, tmp_path / "e1", CFG, {})
    with pytest.raises(InvalidRequestError, match="no fc bias"):
        export_head(tmp_path / "e1", target, "vllm", tmp_path / "x")
    with pytest.raises(InvalidRequestError, match="speculators"):
        export_head(tmp_path / "e1", target, "speculators", tmp_path / "x")
    export_head(tmp_path / "e1", target, "sglang", tmp_path / "sg")
    _same_eagle(head, load_head(tmp_path / "sg", target))
    medusa = _randomise(MedusaHeads(H, 2))
    medusa.attach(target.lm_head.weight, None)
    save_head(medusa, tmp_path / "m", CFG, {})
    with pytest.raises(InvalidRequestError, match="vLLM only"):
        export_head(tmp_path / "m", target, "sglang", tmp_path / "x")
    config = export_head(tmp_path / "m", target, "vllm", tmp_path / "mv")
    assert config["original_lm_head"] and config["num_heads"] == 2
    # SGLang captures features where they enter a layer: not the last layer's output
    last = Eagle3Head(CFG, V, aux_layers=(0, 1, CFG.num_layers))
    last.attach(target.embed_tokens, None)
    save_head(last, tmp_path / "last", CFG, {})
    with pytest.raises(InvalidRequestError, match="last layer's output"):
        export_head(tmp_path / "last", target, "sglang", tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_export_replaces_only_its_own_exports(target, tmp_path):
    """A folder holding a head (a trained one, or one downloaded: the same two files) is never
    replaced; a previous export is, whole: none of its files outlives the new one."""
    head = _randomise(EagleHead(CFG, fc_bias=True))
    head.attach(target.embed_tokens, target.lm_head.weight, None)
    save_head(head, tmp_path / "a", CFG, {})
    (tmp_path / "a" / "training.json").write_text("{}")
    save_head(head, tmp_path / "b", CFG, {})
    before = (tmp_path / "b" / "model.safetensors").read_bytes()
    with pytest.raises(InvalidRequestError, match="did not write"):
        export_head(tmp_path / "a", target, "sglang", tmp_path / "b")
    assert (tmp_path / "b" / "model.safetensors").read_bytes() == before
    export_head(tmp_path / "a", target, "sglang", tmp_path / "out")
    assert (tmp_path / "out" / "training.json").is_file()
    export_head(tmp_path / "b", target, "sglang", tmp_path / "out")  # b has no training.json
    names = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert names == ["config.json", "model.safetensors", "specdecode_export.json"]


def test_a_head_warns_on_another_target(target, tmp_path, caplog):
    """A head records its target (depth, an embedding sample); given another model of the same
    width and vocabulary, loading warns (it drafts poorly there), and the same model in
    another precision does not."""
    from specdecode.models.head_io import target_signature

    head = _randomise(EagleHead(CFG, fc_bias=True))
    head.attach(target.embed_tokens, target.lm_head.weight, None)
    save_head(head, tmp_path / "e", CFG, {}, target_signature(target))
    with caplog.at_level("WARNING"):
        load_head(tmp_path / "e", target)
        torch.manual_seed(0)  # the fixture's seed: the same weights, here rounded to bf16
        load_head(tmp_path / "e", LlamaModel(CFG).eval().to(torch.bfloat16).float())
        assert not caplog.records
        torch.manual_seed(1)
        load_head(tmp_path / "e", LlamaModel(CFG).eval())
    assert "trained on another target model" in caplog.text and "embeddings" in caplog.text


def test_medusa_with_a_draft_vocabulary_exports_over_the_whole_vocabulary(target, tmp_path):
    """vLLM 0.32 cannot load a Medusa `token_map` (its weight check counts the map as never
    loaded; found serving an export there), so a head over a reduced draft vocabulary exports
    over the target's whole vocabulary: its draft rows' logits are unchanged. A vLLM checkpoint
    with full-vocabulary projections and a token_map (older vLLM) loads their draft rows, and
    exports them at their target ids; a token_map that is not distinct target ids is refused."""
    from safetensors.torch import load_file

    vocab = torch.tensor([3, 0, 17, 40, 41, 9])
    medusa = _randomise(MedusaHeads(H, 2))
    medusa.attach(target.lm_head.weight, vocab)
    save_head(medusa, tmp_path / "m", CFG, {})
    config = export_head(tmp_path / "m", target, "vllm", tmp_path / "mv")
    assert "truncated_vocab_size" not in config and config["original_lm_head"]
    tensors = load_file(str(tmp_path / "mv" / "model.safetensors"))
    assert "token_map" not in tensors
    assert torch.equal(tensors["lm_head.weight"], target.lm_head.weight.to(torch.bfloat16))
    loaded = load_head(tmp_path / "mv", target)
    assert loaded.vocab_ids is None
    x = torch.randn(4, H)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x)[..., vocab], medusa(x))
    tensors["token_map"] = vocab
    config["truncated_vocab_size"] = 6

    projs = [torch.randn(V, H).to(torch.bfloat16).float() for _ in range(2)]
    full = {k: v for k, v in tensors.items() if k != "lm_head.weight"}
    full |= {f"lm_heads.{i}.weight": w for i, w in enumerate(projs)}
    vllm_config = {**config, "original_lm_head": False}
    _write(tmp_path / "own", vllm_config, full)
    own = load_head(tmp_path / "own", target)
    with torch.no_grad():
        feats = medusa.features(x)
        want = torch.stack([feats[:, k] @ projs[k][vocab].T for k in range(2)], dim=1)
        torch.testing.assert_close(own(x), want)
    assert torch.equal(own.vocab_ids, vocab)
    # own projections over a draft vocabulary export at their target ids, zero elsewhere
    export_head(tmp_path / "own", target, "vllm", tmp_path / "ownv")
    back = load_head(tmp_path / "ownv", target)
    with torch.no_grad():
        torch.testing.assert_close(back(x)[..., vocab], own(x), atol=2e-2, rtol=2e-2)
        rest = torch.ones(V, dtype=torch.bool)
        rest[vocab] = False
        assert not back(x)[..., rest].any()
    for bad in (torch.tensor([3, 0, 17, 40, 41, 3]), torch.tensor([3, 0, 17, 40, 41, V])):
        _write(tmp_path / "bad", vllm_config, {**full, "token_map": bad})
        with pytest.raises(InvalidRequestError, match="token_map"):
            load_head(tmp_path / "bad", target)
    # its rows are a draft vocabulary already: a token map cannot pick others (nor an EAGLE-3
    # head's, whose LM head is its own)
    with pytest.raises(InvalidRequestError, match="cannot choose other rows"):
        load_head(tmp_path / "own", target, token_map=torch.tensor([0, 3]))
    # a token_map vLLM would ignore (no truncated size below the target's) is ignored here too
    _write(tmp_path / "whole", {**vllm_config, "truncated_vocab_size": None}, full)
    assert load_head(tmp_path / "whole", target).vocab_ids is None


def test_serve_commands_draft_as_many_tokens_as_a_medusa_head_has_heads():
    """vLLM sets a Medusa config's head count to num_speculative_tokens: the command names the
    exported head's own count (5 for a 4-head export would build a head it cannot load)."""
    from specdecode.export import serve_command

    medusa = serve_command("vllm", "medusa", "T", "out/m", num_heads=4)
    assert '"method": "medusa"' in medusa and '"num_speculative_tokens": 4' in medusa
    eagle = serve_command("vllm", "eagle3", "T", "out/e", num_heads=None)
    assert '"method": "eagle3"' in eagle and '"num_speculative_tokens": 5' in eagle


def test_serve_commands_and_notes_say_what_the_serving_side_needs(tmp_path):
    """vLLM serves a speculators checkpoint alone only if its verifier is a Hub id: with a
    local target the command names the target; Medusa left vLLM after 0.32; an EAGLE-1 head's
    draft vocabulary does not travel."""
    from specdecode.export import export_notes, serve_command
    from specdecode.models.registry import REGISTRY

    assert serve_command("speculators", "eagle3", "org/t", "out/s") == "vllm serve out/s"
    from specdecode.cli import _is_hub_id

    assert _is_hub_id("HuggingFaceTB/SmolLM2-135M-Instruct") and not _is_hub_id("/models/t")
    assert not _is_hub_id("a/b/c") and not _is_hub_id(str(tmp_path))  # (a folder that exists)
    local = serve_command("speculators", "eagle3", "/models/t", "out/s", remote=False)
    assert local.startswith("vllm serve /models/t --speculative-config") and "out/s" in local
    assert any("local directory" in n for n in export_notes("speculators", "eagle3", remote=False))
    assert export_notes("speculators", "eagle3", remote=True) == []
    assert any("0.32" in n for n in export_notes("vllm", "medusa"))
    assert any("12288 tokens" in n for n in export_notes("vllm", "eagle", 12288))
    assert any("--speculative-token-map" in n for n in export_notes("sglang", "eagle", 12288))
    sglang = serve_command("sglang", "eagle", "T", "out/e", token_map=True)
    assert sglang.endswith("--speculative-token-map out/e/token_map.pt")
    assert "token-map" not in serve_command("sglang", "eagle", "T", "out/e")
    assert export_notes("vllm", "eagle", None) == []
    smol = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 14, 26]}}
    assert export_notes("sglang", "eagle3", config=smol) == []  # any SGLang loads it
    tiny = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [-1, 0]}}
    assert any("0.5.23" in n for n in export_notes("sglang", "eagle3", config=tiny))
    assert all(m.hub_id.startswith("Qwen/") for m in REGISTRY.values())


def test_heads_of_qwen_targets_export_as_llama_layers(tmp_path):
    """A Qwen2 target's head has q/k/v biases: vLLM's Llama layer takes them with
    `attention_bias`, which also gives o_proj a bias (written as zeros, read back as none);
    SGLang's has none, so it is refused there, as Qwen3's q/k norms are everywhere. A plain
    Llama-layer head loads onto the Qwen2 target (no bias is a zero bias)."""
    from dataclasses import replace

    from safetensors.torch import load_file

    qwen2 = replace(CFG, family="qwen2", attention_bias=True)
    torch.manual_seed(0)
    target = LlamaModel(qwen2).eval()
    head = _randomise(Eagle3Head(qwen2, V))
    head.attach(target.embed_tokens, torch.arange(V))
    save_head(head, tmp_path / "ours", qwen2, {})
    config = export_head(tmp_path / "ours", target, "vllm", tmp_path / "vllm")
    tensors = load_file(str(tmp_path / "vllm" / "model.safetensors"))
    assert config["attention_bias"] and "midlayer.self_attn.q_proj.bias" in tensors
    assert not tensors["midlayer.self_attn.o_proj.bias"].any()
    _same_eagle(head, load_head(tmp_path / "vllm", target))
    with pytest.raises(InvalidRequestError, match="SGLang"):
        export_head(tmp_path / "ours", target, "sglang", tmp_path / "sglang")
    plain = {k: v for k, v in tensors.items() if not k.endswith(("_proj.bias",))}
    _write(tmp_path / "llama", {**config, "attention_bias": False}, plain)
    loaded = load_head(tmp_path / "llama", target)
    assert not loaded.layers[0].self_attn.qkv_proj.bias.any()

    # Qwen3: a head with the target's q/k norms cannot be exported (and still loads here);
    # the heads trained here are Llama layers, which export everywhere and read back
    from types import SimpleNamespace

    from specdecode.train.heads import _layer_config

    qwen3 = replace(CFG, family="qwen3", qk_norm=True)
    target3 = LlamaModel(qwen3).eval()
    head3 = _randomise(Eagle3Head(qwen3, V))
    head3.attach(target3.embed_tokens, torch.arange(V))
    save_head(head3, tmp_path / "q3", qwen3, {})
    with pytest.raises(InvalidRequestError, match="q/k norms"):
        export_head(tmp_path / "q3", target3, "vllm", tmp_path / "q3-vllm")
    _same_eagle(head3.eval(), load_head(tmp_path / "q3", target3))
    trained = _layer_config(target3, SimpleNamespace(init_head=None))
    assert not trained.qk_norm and trained.num_layers == qwen3.num_layers
    head3 = _randomise(Eagle3Head(trained, V))
    head3.attach(target3.embed_tokens, torch.arange(V))
    save_head(head3, tmp_path / "q3-llama", qwen3, {})
    for fmt in ("vllm", "sglang", "speculators"):
        export_head(tmp_path / "q3-llama", target3, fmt, tmp_path / f"q3-{fmt}")
        _same_eagle(head3.eval(), load_head(tmp_path / f"q3-{fmt}", target3))


def test_sglang_eagle1_gets_a_zero_fc_bias_and_eagle3_layers_must_exist(target, tmp_path):
    from safetensors.torch import load_file

    head = _randomise(EagleHead(CFG, fc_bias=False))
    head.attach(target.embed_tokens, target.lm_head.weight, None)
    save_head(head, tmp_path / "e1", CFG, {})
    export_head(tmp_path / "e1", target, "sglang", tmp_path / "e1-sglang")
    tensors = load_file(str(tmp_path / "e1-sglang" / "model.safetensors"))
    assert not tensors["fc.bias"].any()  # SGLang's fc always has one
    config = json.loads((tmp_path / "e1-sglang" / "config.json").read_text())
    # a "bias" key would give SGLang's / vLLM's Llama layer q/k/v/o biases the head lacks
    assert not config.get("bias") and not config.get("attention_bias")
    _same_eagle(head, load_head(tmp_path / "e1-sglang", target))
    assert not (tmp_path / "e1-sglang" / "token_map.pt").exists()  # the whole vocabulary
    # a draft vocabulary goes to SGLang as its --speculative-token-map (FR-Spec): a tensor of
    # target ids, the one file SGLang reads it from (torch.load); re-exported elsewhere, gone
    vocab = torch.tensor([0, 3, 9, 17, 40])
    head.attach(target.embed_tokens, target.lm_head.weight, vocab)
    save_head(head, tmp_path / "e1v", CFG, {})
    export_head(tmp_path / "e1v", target, "sglang", tmp_path / "e1v-sglang")
    mapped = torch.load(tmp_path / "e1v-sglang" / "token_map.pt", weights_only=True)
    assert mapped.dtype == torch.int64 and torch.equal(mapped, vocab)
    from specdecode.models.token_map import load_token_map

    served = load_token_map(tmp_path / "e1v-sglang" / "token_map.pt", V, allow_pickle=True)
    assert torch.equal(served, vocab)  # and it serves here with the same vocabulary
    assert load_head(tmp_path / "e1v-sglang", target).vocab_ids is None  # (safetensors only)
    export_head(tmp_path / "e1v", target, "vllm", tmp_path / "e1v-sglang")
    assert not (tmp_path / "e1v-sglang" / "token_map.pt").exists()
    head3 = _eagle3(target, torch.arange(V))
    tensors = {k.replace("layers.0.", "midlayer."): v for k, v in _unfused(head3, CFG).items()}
    deep = [2, CFG.num_layers + 5, CFG.num_layers + 20]  # a deeper target's layers
    config = {**LLAMA, "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": V,
              "eagle_aux_hidden_state_layer_ids": deep}  # fmt: skip
    _write(tmp_path / "deep", config, tensors)
    with pytest.raises(InvalidRequestError, match="another target"):
        load_head(tmp_path / "deep", target)
    headless = {k: v for k, v in tensors.items() if k != "lm_head.weight"}
    _write(tmp_path / "headless", {**config, "eagle_aux_hidden_state_layer_ids": None}, headless)
    with pytest.raises(InvalidRequestError, match="no lm_head"):
        load_head(tmp_path / "headless", target)


@pytest.mark.parametrize("fmt", ["vllm", "sglang", "speculators"])
def test_a_head_layer_shaped_unlike_the_target_loads_and_exports(target, tmp_path, fmt):
    from specdecode.models.head_io import head_layer_config

    layer = head_layer_config(OWN_HEAD_LAYER, CFG)
    vocab = torch.tensor([0, 3, 4, 10, 50, 95])
    head = _randomise(Eagle3Head(layer, vocab.numel()))
    head.attach(target.embed_tokens, vocab)
    head.eval()
    tensors = {k.replace("layers.0.", "midlayer."): v for k, v in _unfused(head, layer).items()}
    tensors["d2t"] = vocab - torch.arange(6)
    config = {**LLAMA, **OWN_HEAD_LAYER, "architectures": ["LlamaForCausalLMEagle3"]}
    _write(tmp_path / "safeailab", {**config, "draft_vocab_size": 6}, tensors)
    loaded = load_head(tmp_path / "safeailab", target)
    assert loaded.config == head.config and loaded.config.rope.theta == 5e5
    _same_eagle(head, loaded)
    export_head(tmp_path / "safeailab", target, fmt, tmp_path / fmt)
    again = load_head(tmp_path / fmt, target)
    assert again.config == head.config
    _same_eagle(head, again)


def test_continuing_a_head_keeps_its_own_layer_shape(target, tmp_path):
    """`train eagle3 --init DIR` on a head of its own layer shape trains that shape."""
    from types import SimpleNamespace

    from specdecode.models.head_io import head_layer_config
    from specdecode.train.heads import _layer_config

    head = _randomise(Eagle3Head(head_layer_config(OWN_HEAD_LAYER, CFG), 6))
    head.attach(target.embed_tokens, torch.arange(6))
    save_head(head, tmp_path, CFG, {})
    prev = load_head(tmp_path, target)
    again = Eagle3Head(_layer_config(target, SimpleNamespace(init_head=prev)), 6)
    again.load_state_dict(prev.state_dict())  # the shapes agree
    assert again.config == prev.config


def test_a_head_layer_that_cannot_be_built_is_refused(target, tmp_path):
    head = _randomise(EagleHead(CFG))
    config = {**LLAMA, "architectures": ["LlamaForCausalLM"], "num_key_value_heads": 3}
    _write(tmp_path, config, _unfused(head, CFG))
    with pytest.raises(InvalidRequestError, match="no valid layer"):
        load_head(tmp_path, target)


def test_a_head_config_reads_rope_as_the_engines_do():
    """A config that describes the layer but names no RoPE means Hugging Face's default theta
    (as vLLM and SGLang load it), whatever the target's; one naming no layer keeps the
    target's. An unsupported or malformed rope_scaling is a clear refusal."""
    from dataclasses import replace

    from specdecode.config import RopeConfig
    from specdecode.models.head_io import head_layer_config

    llama3 = replace(CFG, rope=RopeConfig(theta=5e5))
    assert head_layer_config(LLAMA, llama3).rope == RopeConfig(theta=10000.0)
    assert head_layer_config({"draft_vocab_size": 6}, llama3).rope == llama3.rope
    assert head_layer_config({**LLAMA, "rope_theta": 5e5}, CFG).rope == llama3.rope
    for scaling in ({"rope_type": "yarn", "factor": 4.0}, "linear"):
        with pytest.raises(InvalidRequestError, match="head's config.json"):
            head_layer_config({**LLAMA, "rope_scaling": scaling}, CFG)


def test_a_head_whose_config_disagrees_with_its_tensors_is_refused(target, tmp_path):
    head = _randomise(EagleHead(CFG))
    config = {**LLAMA, "architectures": ["LlamaForCausalLM"], "num_attention_heads": 8}
    _write(tmp_path, config, _unfused(head, CFG))
    with pytest.raises(InvalidRequestError, match="shape"):
        load_head(tmp_path, target)


@pytest.mark.parametrize("fmt", ["vllm", "speculators"])
def test_eagle3_exports_load_as_vllm_builds_them(target, tmp_path, fmt):
    """What vLLM 0.34's llama_eagle3 needs: no d2t for a draft vocabulary as large as the
    target's (it has no map then and refuses one; our rows are put in the target's order), the
    number of feature layers (its fc is 3 wide unless told), and speculators' residual variant
    kept. A head over the whole vocabulary is saved without a map too."""
    perm = torch.randperm(V, generator=torch.Generator().manual_seed(0))
    head = _eagle3(target, perm)
    head.set_variant(norm_before_residual=True)
    assert len(head.aux_layers) == 2
    save_head(head, tmp_path / "ours", CFG, {})
    config = export_head(tmp_path / "ours", target, fmt, tmp_path / fmt, "org/target")
    from safetensors import safe_open

    with safe_open(str(tmp_path / fmt / "model.safetensors"), "pt") as f:
        assert "d2t" not in f.keys() and "t2d" not in f.keys()
    layer = config["transformer_layer_config"] if fmt == "speculators" else config
    assert layer["num_aux_hidden_states"] == 2
    assert config["norm_before_residual"] is True
    loaded = load_head(tmp_path / fmt, target)
    assert loaded.vocab_ids is None and loaded.norm_before_residual
    x = torch.randn(3, H)
    with torch.no_grad():  # the same distribution, in the target's token order
        torch.testing.assert_close(loaded.logits(x)[:, perm], head.logits(x))
    whole = _eagle3(target, perm)
    whole.vocab_ids = None
    save_head(whole, tmp_path / "whole", CFG, {})
    assert load_head(tmp_path / "whole", target).vocab_ids is None
