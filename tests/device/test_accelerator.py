"""The engine, every drafter, the verifier and head training on an accelerator (CUDA).

They run on CUDA where a GPU is visible and on the CPU elsewhere (CI has no GPU: there they
keep this file from going stale for the day a GPU is lent); `SPECDECODE_TEST_DEVICE` picks the
device. Exactness is claimed in fp32 (TF32 stays off), as on the CPU: greedy and seeded outputs
of every drafter equal plain decoding's on the same device, the device decodes as the CPU does,
and the sampled distribution is unchanged.
"""

from __future__ import annotations

import os
import re

import pytest
import torch
from helpers import (
    assert_seeded_outputs_match,
    chi_square_pvalue,
    seeded_params,
    train_tiny_heads,
)

from specdecode import LLM, SamplingParams

# fp32 means fp32: NVIDIA's containers set this override, which turns TF32 on in cuBLAS
# whatever the flags say (read when CUDA starts, after this import)
os.environ.pop("TORCH_ALLOW_TF32_CUBLAS_OVERRIDE", None)
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False

DEVICE = os.environ.get("SPECDECODE_TEST_DEVICE") or (
    "cuda" if torch.cuda.is_available() else "cpu"
)
pytestmark = pytest.mark.skipif(
    DEVICE.startswith("cuda") and not torch.cuda.is_available(), reason="no CUDA device"
)

PROMPTS = ["say 3 1 9", "abcabcabcabc", "xyz", "hello 42 hello 42"]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def plain(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), device=DEVICE)
    assert llm.engine.runner.device.type == torch.device(DEVICE).type
    return llm


@pytest.fixture(scope="module")
def heads(plain, tiny_llama_dir, tmp_path_factory):
    """Data generated and heads trained on the device (the whole pipeline runs there)."""
    return train_tiny_heads(plain, tiny_llama_dir, tmp_path_factory.mktemp("device-heads"), DEVICE)


def test_the_device_decodes_as_the_cpu_does(plain, tiny_llama_dir):
    """fp32 greedy decoding on the device gives the CPU's tokens (paged attention, RoPE and
    sampling all run there), batched and alone."""
    cpu = LLM(str(tiny_llama_dir), device="cpu")
    want = tokens(cpu.generate(PROMPTS, greedy(32)))
    assert tokens(plain.generate(PROMPTS, greedy(32))) == want
    assert tokens(plain.generate(PROMPTS[1], greedy(32))) == want[1:2]


def test_training_on_the_device_learns(heads):
    _, history = heads
    assert history["medusa"]["after"]["loss"] < history["medusa"]["before"]["loss"]
    assert history["eagle"]["after"]["ce"] < history["eagle"]["before"]["ce"]
    assert history["eagle3"]["after"]["ce"] < history["eagle3"]["before"]["ce"]


def _draft_dir(tmp_path_factory):
    from conftest import _write_byte_tokenizer, make_tiny_hf

    out = tmp_path_factory.mktemp("device-draft")
    make_tiny_hf("llama", out, seed=7)
    _write_byte_tokenizer(out)
    return out


CONFIGS = [
    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1},
    {"method": "draft_model", "model": "SELF", "num_speculative_tokens": 3},
    {"method": "draft_model", "model": "OTHER", "num_speculative_tokens": 3},
    {"method": "medusa", "model": "HEAD"},  # its default static tree
    {"method": "eagle", "model": "HEAD"},  # the defaults: an EAGLE-2 tree
    {"method": "eagle", "model": "HEAD", "topk": 3, "num_draft_tokens": 6},  # another tree
    {"method": "eagle3", "model": "HEAD", "num_speculative_tokens": 4, "topk": 1},
    {"method": "eagle3", "model": "HEAD", "prompt_lookup_tokens": 6, "prompt_lookup_min": 1},
    # an imported Medusa with projections of its own (FasterDecoding's layout), and those cut
    # by a token map (FR-Spec): its tensors live where the target does
    {"method": "medusa", "model": "OWN"},
    {"method": "medusa", "model": "OWN", "token_map": "MAP"},
]


def _own_projection_medusa(heads, tiny_llama_dir, root):
    """The trained Medusa head in FasterDecoding's layout, each head projecting with its own
    copy of the target's LM head."""
    import json

    from safetensors.torch import load_file, save_file

    from specdecode.models.loader import load_model

    out = root / "medusa-own"
    if out.is_dir():
        return out
    out.mkdir()
    lm = load_model(tiny_llama_dir).model.lm_head.weight.detach().float()
    tensors = load_file(str(heads[0] / "medusa" / "model.safetensors"))
    own = {k.removeprefix("medusa_head."): v for k, v in tensors.items() if "linear" in k}
    n = 1 + max(int(k.split(".")[0]) for k in own)
    layers = 1 + max(int(k.split(".")[1]) for k in own)
    own |= {f"{i}.{layers}.weight": lm.clone() for i in range(n)}
    save_file(own, str(out / "medusa_lm_head.safetensors"))
    config = {"medusa_num_heads": n, "medusa_num_layers": layers, "base_model_name_or_path": "t"}
    (out / "config.json").write_text(json.dumps(config))
    (root / "map.json").write_text(json.dumps(list(range(0, lm.shape[0], 2))))
    return out


def _spec(cfg, tiny_llama_dir, heads, tmp_path_factory, policy="static"):
    cfg = dict(cfg)
    if cfg.get("model") == "HEAD":
        cfg["model"] = str(heads[0] / cfg["method"])
    elif cfg.get("model") == "SELF":
        cfg["model"] = str(tiny_llama_dir)
    elif cfg.get("model") == "OTHER":
        cfg["model"] = str(_draft_dir(tmp_path_factory))
    elif cfg.get("model") == "OWN":
        cfg["model"] = str(_own_projection_medusa(heads, tiny_llama_dir, heads[0]))
        if cfg.get("token_map") == "MAP":
            cfg["token_map"] = str(heads[0] / "map.json")
    return LLM(
        str(tiny_llama_dir), device=DEVICE, speculative_config=cfg, speculative_policy=policy
    )


@pytest.mark.parametrize(
    "cfg", CONFIGS, ids=lambda c: f"{c['method']}-{c.get('model', '')}{'-map' * ('token_map' in c)}"
)
def test_greedy_equals_plain(plain, tiny_llama_dir, heads, tmp_path_factory, cfg):
    spec = _spec(cfg, tiny_llama_dir, heads, tmp_path_factory)
    want = tokens(plain.generate(PROMPTS, greedy(30)))
    assert tokens(spec.generate(PROMPTS, greedy(30))) == want
    for prompt, w in zip(PROMPTS, want, strict=True):
        assert tokens(spec.generate(prompt, greedy(30))) == [w]
    stats = spec.engine.spec_stats
    assert stats.num_accepted_tokens > 0, "the test must exercise accepted drafts"


@pytest.mark.parametrize("cfg", [CONFIGS[0], CONFIGS[3], CONFIGS[7]], ids=["ngram", "m", "e3"])
def test_seeded_sampling_gives_the_plain_tokens(
    plain, tiny_llama_dir, heads, tmp_path_factory, cfg
):
    """Deterministic drafts (lookup, heads' trees) verified by the target's position-seeded
    draw give plain decoding's tokens."""
    spec = _spec(cfg, tiny_llama_dir, heads, tmp_path_factory)
    params = seeded_params(3, 30, ((0.3, 3), (0.7, 0), (1.0, 2), (0.5, 5)))
    assert_seeded_outputs_match(plain, spec, PROMPTS, params, alone=1)


def test_penalties_bias_and_prefix_caching_keep_greedy_equal(plain, tiny_llama_dir):
    """Penalties and logit bias are applied per draft node on the device; a cached prefix is
    reused there too."""
    spec = LLM(
        str(tiny_llama_dir),
        device=DEVICE,
        speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1},
        speculative_policy="static",
    )
    params = SamplingParams(
        temperature=0,
        max_tokens=30,
        ignore_eos=True,
        presence_penalty=0.5,
        frequency_penalty=0.3,
        repetition_penalty=1.2,
        logit_bias={97: 2.0, 98: -1.0},
    )
    assert tokens(spec.generate(PROMPTS, params)) == tokens(plain.generate(PROMPTS, params))
    long = "the same long prefix of forty tokens or so " * 2
    first = spec.generate(long + "a", greedy(8))[0]
    again = spec.generate(long + "b", greedy(8))[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens >= 16
    assert tokens([again]) == tokens(plain.generate(long + "b", greedy(8)))


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_sampled_distribution_unchanged(sharp_llama_dir, tmp_path_factory, method):
    """Chi-square homogeneity on the first three tokens, 2000 seeded samples each way at
    temperature 1: deterministic lookup drafts, and a draft model's sampled drafts, whose
    q and residual max(p - q, 0) the rejection sampler computes on the device."""
    plain = LLM(str(sharp_llama_dir), device=DEVICE)
    cfg = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    if method == "draft_model":
        cfg = {"method": "draft_model", "model": str(_draft_dir(tmp_path_factory)),
               "num_speculative_tokens": 3}  # fmt: skip
    spec = LLM(str(sharp_llama_dir), device=DEVICE, speculative_config=cfg,
               speculative_policy="static")  # fmt: skip
    assert spec.engine.drafter.samples_drafts == (method == "draft_model")
    prompt = "abcabcabc" + plain.generate("abcabcabc", greedy(60))[0].outputs[0].text
    n = 2000

    def run(llm, offset):
        params = [
            SamplingParams(max_tokens=3, ignore_eos=True, seed=offset + s, temperature=1.0, top_k=8)
            for s in range(n)
        ]
        return tokens(llm.generate([prompt] * n, params))

    a, b = run(plain, 0), run(spec, n)
    for pos in range(3):
        assert chi_square_pvalue([t[pos] for t in a], [t[pos] for t in b]) > 1e-3, pos
    stats = spec.engine.spec_stats
    assert stats.num_accepted_tokens > 100
    assert stats.num_draft_tokens > stats.num_accepted_tokens + 100  # and residual draws


def test_draft_distillation_on_the_device(plain, tiny_llama_dir, heads):
    """`train draft` (teacher features, losses) on the device, then served losslessly."""
    from specdecode.models.loader import load_model
    from specdecode.train.draft import DraftTrainConfig, train_draft

    root, _ = heads
    target = load_model(tiny_llama_dir, device=DEVICE).model
    cfg = DraftTrainConfig(
        num_layers=1, draft_vocab=64, steps=20, batch_size=8, lr=3e-3, eval_examples=8
    )
    history = train_draft(target, root / "data", root / "draft", cfg, [2], tiny_llama_dir)
    assert history["after"]["loss"] < history["before"]["loss"]
    spec = LLM(
        str(tiny_llama_dir),
        device=DEVICE,
        speculative_config={
            "method": "draft_model",
            "model": str(root / "draft"),
            "num_speculative_tokens": 3,
        },
        speculative_policy="static",
    )
    want = tokens(plain.generate(PROMPTS, greedy(20)))
    assert tokens(spec.generate(PROMPTS, greedy(20))) == want
    assert spec.engine.spec_stats.num_draft_tokens > 0


def test_bf16_serving_with_a_head_runs(tiny_llama_dir, heads):
    """bf16 on the device (no equality claim: near-ties flip between 1-token and tree passes)."""
    spec = LLM(
        str(tiny_llama_dir),
        device=DEVICE,
        dtype="bfloat16",
        speculative_config={"method": "eagle3", "model": str(heads[0] / "eagle3")},
    )
    out = spec.generate(PROMPTS, greedy(24))
    assert all(len(o.outputs[0].token_ids) == 24 for o in out)
    assert all(0 <= t < 128 for o in out for t in o.outputs[0].token_ids)


def test_structured_output_on_the_device(plain):
    """The grammar's token mask (built on the CPU) applied to the device's logits."""
    pytest.importorskip("xgrammar")
    params = SamplingParams(
        temperature=0, max_tokens=40, structured_output={"regex": "[0-9]{3}-[a-c]+"}
    )
    text = plain.generate("say 3 1 9", params)[0].outputs[0].text
    assert re.fullmatch("[0-9]{3}-[a-c]+", text), text


@pytest.mark.skipif(not DEVICE.startswith("cuda"), reason="a GPU memory fraction needs CUDA")
def test_gpu_memory_utilization_holds_the_weights_and_every_cache(tiny_llama_dir, heads):
    """vLLM's --gpu-memory-utilization: a drafter's weights and cache are inside the fraction,
    and the target's cache takes the rest (greedy output still equals plain decoding's)."""
    device = torch.device(DEVICE)
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated(device)
    fraction = min(0.9, (before + (1 << 30)) / total)  # (1 GB past what is in use already)
    spec = LLM(
        str(tiny_llama_dir),
        device=DEVICE,
        gpu_memory_utilization=fraction,
        speculative_config={"method": "eagle3", "model": str(heads[0] / "eagle3")},
    )
    used = torch.cuda.memory_allocated(device)
    assert used <= fraction * total
    assert spec.engine.manager.capacity_tokens > 1000
    plain = LLM(str(tiny_llama_dir), device=DEVICE)
    assert tokens(spec.generate(PROMPTS, greedy(16))) == tokens(plain.generate(PROMPTS, greedy(16)))
