"""The real default model, SmolLM2-135M-Instruct (Q4_1 GGUF dequantized to fp32)."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import PARENTS, Runner, ancestor_mask, depth, path_to
from transformers import AutoModelForCausalLM

from specdecode.cache import keep_path
from specdecode.models.loader import default_gguf_path

pytestmark = pytest.mark.slow
ATOL = 1e-4


@pytest.fixture(scope="module")
def hf(smol):
    loaded, _ = smol
    return AutoModelForCausalLM.from_pretrained(str(loaded.path), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def chat_ids(smol):
    _, tok = smol
    text = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert text.endswith("<|im_start|>assistant\n")
    return tok(text, add_special_tokens=False).input_ids


def test_logits_match_transformers(smol, hf, chat_ids):
    loaded, _ = smol
    r = Runner(loaded.model, num_blocks=32, block_size=16)
    (ours,) = r.feed([r.new_seq()], [chat_ids])
    with torch.no_grad():
        ref = hf(torch.tensor([chat_ids])).logits[0]
    torch.testing.assert_close(ours, ref, atol=ATOL, rtol=0)


def test_fast_path_logits_match_transformers(hf, chat_ids):
    """The packed-kernel C++ path (fp32 weights) on the real model. It sums in another order
    than oneDNN (and approximates exp in SiLU to 1e-7), so it is held to the error budget of
    transformers' own fp32 forward: against a float64 forward, its error must stay within three
    times transformers' (measured: 1.3e-4 vs 0.93e-4 on an AMD EPYC VM, 1.0e-4 vs 0.60e-4 on
    an Intel Xeon VM, on logits of magnitude ~37; a real bug is off by orders of magnitude)."""
    from specdecode.models.fast import accelerate
    from specdecode.models.loader import load_model

    model = load_model(None).model
    if not accelerate(model):
        pytest.skip("CPU kernels unavailable here")
    r = Runner(model, num_blocks=32, block_size=16)
    (ours,) = r.feed([r.new_seq()], [chat_ids])
    x = torch.tensor([chat_ids])
    with torch.no_grad():
        ref = hf(x).logits[0].double()
        exact = copy.deepcopy(hf).double()(x).logits[0]
    hf_error = (ref - exact).abs().max()
    # (and at least 5e-4: where transformers' own error happens to be tiny, a CPU whose kernels
    # sum in yet another order is not a bug)
    assert (ours.double() - exact).abs().max() <= max(3 * hf_error, 5e-4)
    s = r.new_seq()  # decoding one token at a time gives the same logits
    r.feed([s], [chat_ids[:-3]])
    steps = [r.feed([s], [[t]])[0] for t in chat_ids[-3:]]
    torch.testing.assert_close(torch.cat(steps), ours[-3:], atol=ATOL, rtol=0)


def test_gguf_conversion_matches_transformers_gguf_loader(smol, chat_ids):
    """transformers dequantizes the same GGUF its own way (slow: ~15 s); logits must agree."""
    loaded, _ = smol
    path = default_gguf_path()
    ref_model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    r = Runner(loaded.model, num_blocks=32, block_size=16)
    (ours,) = r.feed([r.new_seq()], [chat_ids])
    with torch.no_grad():
        ref = ref_model(torch.tensor([chat_ids])).logits[0]
    torch.testing.assert_close(ours, ref, atol=ATOL, rtol=0)


def test_the_engines_decoder_is_transformers_decode(smol):
    """The output processor calls the Rust tokenizer directly (no clean-up of spaces here):
    the same text as transformers' `decode` on real text, special tokens and random ids."""
    import random

    from specdecode.engine.output import fast_decoder

    _, tok = smol
    decode = fast_decoder(tok)
    assert decode is not tok.decode  # the direct path is the one tested
    rng = random.Random(0)
    texts = ["Hello, world! ", "Ünïcödé 日本語 🙂", "def f(x):\n    return x", "<|im_end|>x"]
    samples = [tok(t).input_ids for t in texts]
    samples += [[rng.randrange(len(tok)) for _ in range(rng.randint(1, 12))] for _ in range(500)]
    for ids in samples:
        for skip in (True, False):
            assert decode(ids, skip_special_tokens=skip) == tok.decode(
                ids, skip_special_tokens=skip
            )


def test_greedy_chat_equals_transformers(smol, hf, chat_ids):
    from specdecode import LLM, SamplingParams

    llm = LLM()
    out = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0, max_tokens=24),
    )[0].outputs[0]
    x = torch.tensor([chat_ids])
    ref = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=24, do_sample=False)
    ref_ids = ref[0, len(chat_ids) :].tolist()
    assert out.token_ids == ref_ids[: len(out.token_ids)]
    assert "Paris" in out.text


def test_tree_forward_and_compaction_on_the_real_model(smol, chat_ids):
    loaded, _ = smol
    model = loaded.model
    tokens = [422, 3575, 314, 5445, 28, 30]
    r = Runner(model, num_blocks=32, block_size=16)
    s = r.new_seq()
    r.feed([s], [chat_ids])
    base = s.length
    pos = [base + depth(PARENTS, i) for i in range(len(PARENTS))]
    (tree,) = r.feed([s], [tokens], positions=[pos], trees=[ancestor_mask(PARENTS)], commit=False)
    path = path_to(PARENTS, 4)
    ref = Runner(model, num_blocks=32, block_size=16)
    t = ref.new_seq()
    (seq_logits,) = ref.feed([t], [chat_ids + [tokens[i] for i in path] + [11]])
    torch.testing.assert_close(tree[path], seq_logits[base:-1], atol=ATOL, rtol=0)
    keep_path(r.manager, r.cache, s, path)
    (after,) = r.feed([s], [[11]])
    torch.testing.assert_close(after, seq_logits[-1:], atol=ATOL, rtol=0)


def test_ngram_greedy_equals_plain_on_the_real_model():
    from specdecode import LLM, SamplingParams

    prompts = [
        [{"role": "user", "content": "Repeat exactly: the cat sat on the mat. the cat sat."}],
        [{"role": "user", "content": "Write a Python function that adds two numbers."}],
    ]
    params = SamplingParams(temperature=0, max_tokens=40)
    plain = LLM()
    want = [o.outputs[0].token_ids for o in plain.chat(prompts, params)]
    spec = LLM(
        speculative_config={"method": "ngram", "num_speculative_tokens": 4},
        speculative_policy="static",
    )
    assert [o.outputs[0].token_ids for o in spec.chat(prompts, params)] == want  # batched
    assert spec.chat(prompts[1], params)[0].outputs[0].token_ids == want[1]  # batch 1
    assert spec.engine.spec_stats.num_accepted_tokens > 0


@pytest.mark.parametrize("tree", [None, [[0], [1], [0, 0], [0, 0, 0]]])
def test_draft_model_greedy_equals_plain_on_the_real_model(smol, tree):
    """The real model drafting for itself (chain, then a top-2 tree): exercises the draft
    cache, rollback and tree verification at full size; output must equal plain greedy."""
    from specdecode import LLM, SamplingParams

    loaded, _ = smol
    prompts = [
        [{"role": "user", "content": "Name three colors."}],
        [{"role": "user", "content": "Write a haiku about the sea."}],
    ]
    params = SamplingParams(temperature=0, max_tokens=32)
    want = [o.outputs[0].token_ids for o in LLM().chat(prompts, params)]
    cfg = {"method": "draft_model", "model": str(loaded.path), "num_speculative_tokens": 3}
    if tree:
        cfg["speculative_token_tree"] = tree
    spec = LLM(speculative_config=cfg, speculative_policy="static")
    assert [o.outputs[0].token_ids for o in spec.chat(prompts, params)] == want
    assert spec.engine.spec_stats.num_accepted_tokens > 0


SHIPPED_HEADS = [
    ("medusa", {}),
    ("eagle", {}),  # the defaults: an EAGLE-2 tree
    ("eagle", {"topk": 1, "num_speculative_tokens": 4}),  # chain
    ("eagle3", {}),
    ("eagle3", {"prompt_lookup_tokens": 8}),  # with a prompt-lookup branch grafted on
]


@pytest.mark.parametrize("method,extra", SHIPPED_HEADS)
def test_shipped_heads_greedy_equal_plain_on_the_real_model(method, extra):
    """The heads shipped for the default model are its defaults when no path is given; fp32
    greedy outputs with them equal plain decoding, batched and at batch 1."""
    from specdecode import LLM, SamplingParams

    prompts = [
        [{"role": "user", "content": "Write a Python function that reverses a string."}],
        [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
        [{"role": "user", "content": "List three fruits."}],
    ]
    params = SamplingParams(temperature=0, max_tokens=40)
    want = [o.outputs[0].token_ids for o in _plain().chat(prompts, params)]
    spec = LLM(speculative_config={"method": method, **extra}, speculative_policy="static")
    assert [o.outputs[0].token_ids for o in spec.chat(prompts, params)] == want
    assert spec.chat(prompts[0], params)[0].outputs[0].token_ids == want[0]
    stats = spec.engine.spec_stats
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0


_PLAIN = []


def _plain():
    from specdecode import LLM

    if not _PLAIN:
        _PLAIN.append(LLM())
    return _PLAIN[0]


@pytest.mark.parametrize("method", ["ngram", "draft_model", "medusa", "eagle", "eagle3"])
def test_structured_output_with_speculation_on_the_real_model(smol, method):
    """A JSON schema on the real tokenizer (byte-level BPE): outputs validate against it (with
    `jsonschema`), tokens are forced, and with speculation, batched and at batch 1, exactly the
    tokens of constrained decoding without it."""
    import json

    import jsonschema

    from specdecode import LLM, SamplingParams

    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "country": {"type": "string", "maxLength": 20},
            "population_millions": {"type": "number"},
        },
        "required": ["city", "country", "population_millions"],
        "additionalProperties": False,
    }
    prompts = [
        [{"role": "user", "content": "Give the capital of France as JSON."}],
        [{"role": "user", "content": "Describe Tokyo as JSON with its population."}],
    ]
    params = SamplingParams(temperature=0, max_tokens=80, structured_output={"json": schema})
    plain = _plain()
    before = plain.engine.num_forced_tokens
    want = plain.chat(prompts, params)
    assert plain.engine.num_forced_tokens > before
    for o in want:
        jsonschema.validate(json.loads(o.outputs[0].text), schema)
    cfg = {"method": method}
    if method == "draft_model":  # the target drafting for itself
        cfg |= {"model": str(smol[0].path), "num_speculative_tokens": 3}
    spec = LLM(speculative_config=cfg, speculative_policy="static")
    got = spec.chat(prompts, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert spec.chat(prompts[1], params)[0].outputs[0].token_ids == want[1].outputs[0].token_ids
    assert spec.engine.spec_stats.num_draft_tokens > 0
