"""Structured output on a tiny model: outputs obey the constraint, forced tokens are appended
without the model, and speculation (any drafter, batched with unconstrained requests) gives
exactly the tokens of constrained decoding without it."""

from __future__ import annotations

import json
import re

import pytest

from specdecode import LLM, SamplingParams
from specdecode.errors import InvalidRequestError
from specdecode.structured import StructuredOutput

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6}, "ok": {"type": "boolean"}},
    "required": ["name", "ok"],
    "additionalProperties": False,
}
REGEX = r"[ab]{2,6}(cd|ef)"
PROMPTS = ["abcabcabc", "Hello Hello", "xyz", "1212121212"]


@pytest.fixture(scope="module")
def plain(tiny_llama_dir):
    return LLM(str(tiny_llama_dir))


def params(so, temperature=0.0, seed=None, n=60) -> SamplingParams:
    return SamplingParams(
        temperature=temperature, seed=seed, max_tokens=n, structured_output=so, top_k=5
    )


def test_regex_output_matches_and_the_end_is_forced(plain):
    outs = plain.generate(PROMPTS, params({"regex": REGEX}))
    for o in outs:
        c = o.outputs[0]
        assert c.finish_reason == "stop"
        assert re.fullmatch(REGEX, c.text), c.text
    seqs_forced = plain.engine.num_forced_tokens
    assert seqs_forced >= len(PROMPTS)  # at least the stop token after "d" / "f" is forced


def test_json_schema_output_parses_and_keys_are_forced(plain):
    before = plain.engine.num_forced_tokens
    for temperature in (0.0, 1.0):
        outs = plain.generate(PROMPTS, params({"json": SCHEMA}, temperature, seed=3))
        for o in outs:
            value = json.loads(o.outputs[0].text)
            assert set(value) == {"name", "ok"} and isinstance(value["ok"], bool)
            assert len(value["name"]) <= 6
    # '{"name":"' and '","ok":' are forced, a character per token here
    assert plain.engine.num_forced_tokens - before >= 8 * 2 * len(PROMPTS)


def test_keys_follow_each_schemas_property_order(plain):
    """Two schemas that differ only in their properties' order are two grammars: the keys come
    out in each one's order (not in that of whichever was compiled first)."""
    swapped = {**SCHEMA, "properties": dict(reversed(SCHEMA["properties"].items()))}
    for schema in (SCHEMA, swapped, SCHEMA):
        text = plain.generate(PROMPTS[0], params({"json": schema}))[0].outputs[0].text
        assert list(json.loads(text)) == list(schema["properties"]), text


SPEC = [
    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1},
    {"method": "draft_model", "num_speculative_tokens": 3},  # the target drafts for itself
    {"method": "draft_model", "num_speculative_tokens": 2, "speculative_token_tree":
        [[0], [1], [0, 0], [1, 0]]},
]  # fmt: skip


@pytest.mark.parametrize("cfg", SPEC, ids=["ngram", "self-draft", "self-draft-tree"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_speculation_gives_the_constrained_tokens(plain, tiny_llama_dir, cfg, temperature):
    if cfg["method"] == "draft_model":
        cfg = {**cfg, "model": str(tiny_llama_dir)}
    spec = LLM(str(tiny_llama_dir), speculative_config=cfg, speculative_policy="static")
    mixed = [
        params({"json": SCHEMA}, temperature, seed=1),
        params(None, temperature, seed=2, n=30),  # unconstrained, same batch
        params({"regex": REGEX}, temperature, seed=3),
        params({"json_object": True}, temperature, seed=4, n=40),
    ]
    want = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, mixed)]
    got = spec.generate(PROMPTS, mixed)
    if temperature == 0 or cfg["method"] == "ngram":  # deterministic drafts: token-identical
        assert [o.outputs[0].token_ids for o in got] == want
    json.loads(got[0].outputs[0].text)
    assert re.fullmatch(REGEX, got[2].outputs[0].text)
    assert spec.engine.spec_stats.num_draft_tokens > 0


def test_bad_constraints_are_refused(plain):
    for bad in ({"regex": "("}, {"json": {"type": "nonsense"}}, {"grammar": "root ::= ("}):
        with pytest.raises(InvalidRequestError):
            plain.generate("abc", params(bad))
    with pytest.raises(InvalidRequestError, match="exactly one"):
        StructuredOutput(regex="a", json_object=True)
    with pytest.raises(InvalidRequestError):
        SamplingParams(structured_output={"pattern": "a"})


def test_a_grammar_the_vocabulary_cannot_write_ends_with_an_error(plain):
    out = plain.generate("abc", params({"regex": "é+"}))[0].outputs[0]
    assert out.finish_reason == "error"


def test_a_draft_into_a_dead_end_ends_as_plain_decoding_does(plain, tiny_llama_dir):
    """A draft the grammar allows but after which it allows no token of the vocabulary (here
    'c', which only 'é' may follow): accepted, it ends the request with the dead end's error
    and the tokens plain decoding emits, instead of failing the whole step."""
    p = SamplingParams(
        temperature=0, max_tokens=10, structured_output={"regex": "a[abd]*(c\u00e9)?d"},
        logit_bias={ord("c"): 50.0},
    )  # fmt: skip
    want = plain.generate(["acccc"], p)[0].outputs[0]
    assert want.finish_reason == "error" and want.token_ids == [ord("a"), ord("c")]
    spec = LLM(
        str(tiny_llama_dir), speculative_policy="static",
        speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
    )  # fmt: skip
    got = spec.generate(["acccc", "abcabc"], [p, params({"regex": REGEX})])
    assert (got[0].outputs[0].token_ids, got[0].outputs[0].finish_reason) == (
        want.token_ids, "error"
    )  # fmt: skip
    assert re.fullmatch(REGEX, got[1].outputs[0].text)  # its batch neighbour is unharmed


def test_constrained_sampled_distribution_unchanged(sharp_llama_dir, tmp_path):
    """Sampled drafts from a softer draft model (q != p), pruned to the grammar and verified
    with masked p and q: each constrained token is distributed as without speculation
    (chi-square homogeneity, 2000 seeded samples each way; p < 1e-3 fails)."""
    from conftest import _write_byte_tokenizer, make_tiny_hf
    from helpers import chi_square_pvalue

    make_tiny_hf("llama", tmp_path, seed=1, logit_scale=3.0)  # same weights, softer
    _write_byte_tokenizer(tmp_path)
    plain = LLM(str(sharp_llama_dir))
    spec = LLM(
        str(sharp_llama_dir),
        speculative_config={
            "method": "draft_model",
            "model": str(tmp_path),
            "num_speculative_tokens": 3,
        },  # fmt: skip
        speculative_policy="static",
    )
    so = {"regex": "[a-h]{2}[0-9a-h]{2}"}

    def run(llm, offset, n=2000):
        ps = [SamplingParams(temperature=1.0, seed=offset + s, max_tokens=5, structured_output=so)
              for s in range(n)]  # fmt: skip
        return [o.outputs[0].text for o in llm.generate(["abcabc"] * n, ps)]

    a, b = run(plain, 0), run(spec, 2000)
    assert all(re.fullmatch(so["regex"], t) for t in a + b)
    for pos in range(4):
        pval = chi_square_pvalue([ord(t[pos]) for t in a], [ord(t[pos]) for t in b])
        assert pval > 1e-3, (pos, pval)
    stats = spec.engine.spec_stats
    assert stats.num_accepted_tokens > 500 and stats.acceptance_rate < 0.95


def test_speculation_stops_at_the_grammar_stop_token_under_ignore_eos(tmp_path):
    """A step that accepts the grammar's stop token as a draft keeps nothing after it: with
    ignore_eos the stop token does not end the request, and the bonus token drawn past it is
    not constrained (it was appended, then the request ended, off the grammar)."""
    from conftest import _write_byte_tokenizer, make_tiny_hf

    make_tiny_hf("llama", tmp_path, seed=1, logit_scale=3.0)
    _write_byte_tokenizer(tmp_path)
    plain = LLM(str(tmp_path))
    cfg = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
    spec = LLM(str(tmp_path), speculative_config=cfg, speculative_policy="static")
    a, b, eos = ord("a"), ord("b"), 2  # the prompt has eos after a and b: lookup drafts it
    prompt = {"prompt_token_ids": [a, eos, b, eos, a, eos, b, eos, ord("x"), a]}
    ps = [
        SamplingParams(temperature=1.0, seed=s, max_tokens=12, ignore_eos=True,
                       structured_output={"regex": "[ab]+"})
        for s in range(24)
    ]  # fmt: skip
    want = [o.outputs[0] for o in plain.generate([prompt] * len(ps), ps)]
    got = [o.outputs[0] for o in spec.generate([prompt] * len(ps), ps)]
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert all(re.fullmatch("[ab]+", g.text) for g in got)
    assert sum(g.token_ids[-1] == eos for g in got) >= 3  # the stop token was reached
    assert spec.engine.spec_stats.num_accepted_tokens > 0


@pytest.mark.parametrize("spec_cfg", [None, SPEC[0]], ids=["plain", "ngram"])
def test_logprobs_stay_aligned_and_raw_under_a_grammar(plain, tiny_llama_dir, spec_cfg):
    """Forced tokens get an entry (logprob 0: no choice under the grammar), so logprobs stay
    one per token; sampled tokens report the model's raw distribution, not the masked one."""
    llm = plain
    if spec_cfg is not None:
        llm = LLM(str(tiny_llama_dir), speculative_config=spec_cfg, speculative_policy="static")
    so = {"regex": r"ab[0-9]cdef[0-9]{1,3}"}
    sp = SamplingParams(temperature=0, max_tokens=20, structured_output=so, logprobs=3)
    out = llm.generate(PROMPTS[0], sp)[0].outputs[0]
    free = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=1, logprobs=3))
    assert re.fullmatch(so["regex"], out.text)
    entries = out.logprobs
    assert len(entries) == len(out.token_ids)
    # "a" was the only token allowed first: masked, its logprob would be 0; raw it is not, and
    # the top-3 is the unconstrained model's at the same position
    assert entries[0][out.token_ids[0]].logprob < 0
    assert _top(entries[0], 3) == _top(free[0].outputs[0].logprobs[0], 3)
    assert entries[0][out.token_ids[0]].rank > 3  # not among them, ranked all the same
    forced = [e for t, e in zip(out.token_ids, entries, strict=True) if _placeholder(t, e)]
    assert len(forced) >= 4  # "cdef" after the digit, at least


def test_forced_tokens_inside_accepted_drafts_read_as_plain_decodings(plain, tiny_llama_dir):
    """A draft the grammar forced (the only token it allowed there) that verification accepts
    gets plain decoding's jump-ahead entry (logprob 0, no model figure) and is counted as
    forced: the same logprobs entries and forced count with speculation as without."""
    spec = LLM(str(tiny_llama_dir), speculative_config=SPEC[0], speculative_policy="static")
    # two letters chosen, then "xyz" forced: the second letter's step drafts (a step right
    # after a jump-ahead feeds the forced tokens and drafts nothing), "xyz" among its drafts
    so = {"regex": r"([a-c]{2}xyz){8}"}
    sp = SamplingParams(temperature=0, max_tokens=60, structured_output=so, logprobs=2)
    prompt = "abxyzabxyz"
    runs = []
    for llm in (plain, spec):
        before = llm.engine.num_forced_tokens
        out = llm.generate(prompt, sp)[0].outputs[0]
        runs.append((out, llm.engine.num_forced_tokens - before))
    (want, want_forced), (got, got_forced) = runs
    assert got.token_ids == want.token_ids and re.fullmatch(so["regex"], got.text)

    def placeholders(out) -> list[bool]:
        return [_placeholder(t, e) for t, e in zip(out.token_ids, out.logprobs, strict=True)]

    placeholder = placeholders(want)
    assert placeholders(got) == placeholder
    assert got_forced == want_forced == sum(placeholder) > 0
    assert spec.engine.spec_stats.num_accepted_tokens > 0


def test_a_forced_run_begun_among_drafts_counts_towards_the_jump_ahead_bound(
    plain, tiny_llama_dir, monkeypatch
):
    """Jump-ahead appends at most `_JUMP_AHEAD` forced tokens a step, counted from a run's
    first; the token after that comes from a model step (a real logprob). Forced drafts that
    began the run inside a step count towards it, so that token is the same one with
    speculation as without (here the bound is 8, the run 30 long)."""
    monkeypatch.setattr("specdecode.engine.engine._JUMP_AHEAD", 8)
    spec = LLM(str(tiny_llama_dir), speculative_config=SPEC[0], speculative_policy="static")
    b = plain.encode("b")[-1]
    so = {"regex": r"a[bc]x{30}"}
    sp = SamplingParams(
        temperature=0, max_tokens=40, structured_output=so, logprobs=1, logit_bias={b: 30.0}
    )
    runs = []
    for llm in (plain, spec):
        out = llm.generate("abxxxxxxxx", sp)[0].outputs[0]  # lookup drafts "xxxx" after "b"
        model = [i for i, (t, e) in enumerate(zip(out.token_ids, out.logprobs, strict=True))
                 if not _placeholder(t, e)]  # fmt: skip
        runs.append((out.token_ids, model))
    assert runs[0] == runs[1] and len(runs[0][1]) > 2, runs
    assert spec.engine.spec_stats.num_accepted_tokens > 0


def _top(entry: dict, n: int) -> list:
    """A logprobs entry's top-n: (rank, token id, logprob), by rank (the sampled token, listed
    first, has its rank too, top-n or not)."""
    return sorted((lp.rank, t, lp.logprob) for t, lp in entry.items() if lp.rank <= n)


def _placeholder(tok: int, entry: dict) -> bool:
    """The entry of a token the grammar forced: logprob 0, itself its only candidate."""
    return list(entry) == [tok] and entry[tok].logprob == 0.0 and entry[tok].rank == 1


def _first_new(text: str, at: int, width: int = 3) -> int:
    """The first position from `at` whose `width` characters first occur there (and are not
    part of a byte token's "<17>" text: its bytes are not its text)."""
    for i in range(at, len(text) - width):
        marker = text[i : i + width]
        if text.find(marker) == i and "<" not in marker and ">" not in marker:
            return i
    raise AssertionError(f"no fresh marker in {text!r}")


@pytest.mark.parametrize("cfg", [None, SPEC[0], SPEC[2]], ids=["plain", "ngram", "tree"])
def test_a_reply_reasons_freely_before_its_constraint(plain, tiny_llama_dir, cfg):
    """`reasoning_end`: the reply is the model's own until it has written the marker, then the
    constraint holds (with speculation too, token-identical to decoding without it)."""
    if cfg is not None and cfg["method"] == "draft_model":
        cfg = {**cfg, "model": str(tiny_llama_dir)}
    llm = (
        plain
        if cfg is None
        else LLM(str(tiny_llama_dir), speculative_config=cfg, speculative_policy="static")
    )
    free = [o.outputs[0].text for o in plain.generate(PROMPTS, params(None, n=40))]
    cuts = [_first_new(t, 5) + 3 for t in free]
    asked = [
        SamplingParams(temperature=0.0, max_tokens=60, top_k=5, structured_output=so,
                       reasoning_end=t[c - 3 : c])
        for t, c, so in zip(free, cuts, [{"regex": REGEX}, {"json": SCHEMA}] * 2, strict=True)
    ]  # fmt: skip
    got = llm.generate(PROMPTS, asked)
    for t, c, o, p in zip(free, cuts, got, asked, strict=True):
        text = o.outputs[0].text
        assert text[:c] == t[:c], (text, p.reasoning_end)
        answer = text[c:]
        if p.structured_output.regex:
            assert re.fullmatch(REGEX, answer), answer
        else:
            json.loads(answer)
    if cfg is not None:
        want = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, asked)]
        assert [o.outputs[0].token_ids for o in got] == want
        assert llm.engine.spec_stats.num_accepted_tokens > 0
