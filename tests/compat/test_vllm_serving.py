"""The shipped SmolLM2 heads, exported here, served by vLLM itself (its CPU build, in its own
environment: `make compat-vllm`; skipped unless SPECDECODE_VLLM_PYTHON names that Python).

Greedy fp32 generation on vLLM, plainly and with each export, must give the tokens this engine
gives, and vLLM's own acceptance counters must show the head drafting there as it drafts here
(a head that loaded with a wrong layer, norm or vocabulary map would still be lossless but
would accept far less). Prompts go in as token ids, so both engines see the same input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

VLLM_PYTHON = os.environ.get("SPECDECODE_VLLM_PYTHON")
pytestmark = pytest.mark.skipif(
    not VLLM_PYTHON, reason="needs a Python with vLLM: make compat-vllm"
)
RUNNER = Path(__file__).with_name("vllm_generate.py")
ASSETS = Path(__file__).resolve().parents[2] / "specdecode" / "assets"
MAX_TOKENS = 48
CHAIN4 = [[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]]
# name: (shipped head, export format, our chain config, vLLM's speculative config)
CASES = {
    "eagle3-vllm": ("smollm2-135m-eagle3", "vllm", {"method": "eagle3", "topk": 1}, "eagle3"),
    "eagle3-speculators": (
        "smollm2-135m-eagle3", "speculators", {"method": "eagle3", "topk": 1}, "eagle3"
    ),
    "eagle-vllm": ("smollm2-135m-eagle", "vllm", {"method": "eagle", "topk": 1}, "eagle"),
    "medusa-vllm": (
        "smollm2-135m-medusa", "vllm",
        {"method": "medusa", "num_speculative_tokens": 4, "speculative_token_tree": CHAIN4},
        "medusa",
    ),
}  # fmt: skip


def _vllm(tmp_path: Path, name: str, model: str, prompts, spec: dict | None) -> dict:
    req, out = tmp_path / f"{name}.req.json", tmp_path / f"{name}.out.json"
    req.write_text(json.dumps({"model": model, "prompts": prompts, "max_tokens": MAX_TOKENS,
                               "speculative_config": spec}))  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    run = subprocess.run(
        [VLLM_PYTHON, str(RUNNER), str(req), str(out)],
        capture_output=True, text=True, timeout=900, env=env,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def ours():
    from specdecode import LLM, SamplingParams
    from specdecode.bench import workloads

    base = LLM(dtype="float32")
    prompts = [
        base._chat_ids(m) for wl in ("code", "chat") for m in workloads.load(wl, 2)
    ]  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    plain = [list(o.outputs[0].token_ids) for o in base.generate(prompts, params)]
    return base, prompts, params, plain


@pytest.fixture(scope="module")
def vllm_plain(ours, tmp_path_factory):
    base, prompts, _, _ = ours
    return _vllm(tmp_path_factory.mktemp("plain"), "plain", str(base.engine.model_path),
                 prompts, None)  # fmt: skip


def test_vllm_decodes_the_default_model_as_this_engine_does(ours, vllm_plain):
    assert vllm_plain["tokens"] == ours[3]


@pytest.mark.parametrize("case", list(CASES))
def test_an_exported_head_drafts_on_vllm_as_it_drafts_here(ours, smol, tmp_path, case):
    from specdecode import LLM
    from specdecode.export import export_head

    base, prompts, params, plain = ours
    asset, fmt, cfg, method = CASES[case]
    out = tmp_path / "export"
    export_head(ASSETS / asset, smol[0].model, fmt, out, str(base.engine.model_path))
    cfg = {"num_speculative_tokens": 5, **cfg}
    spec = LLM(None, share_model_with=base, dtype="float32", speculative_config=cfg,
               speculative_policy="static")  # fmt: skip
    mine = [list(o.outputs[0].token_ids) for o in spec.generate(prompts, params)]
    st = spec.engine.spec_stats
    k = cfg["num_speculative_tokens"]
    theirs = _vllm(tmp_path, case, str(base.engine.model_path), prompts,
                   {"method": method, "model": str(out), "num_speculative_tokens": k})  # fmt: skip
    assert mine == plain and theirs["tokens"] == plain  # lossless on both engines
    here = st.accepted_per_position[0] / st.num_drafts
    there = theirs["spec_decode_num_accepted_tokens_per_pos"][0] / theirs["spec_decode_num_drafts"]
    tau_here = 1 + st.num_accepted_tokens / st.num_drafts
    tau_there = 1 + theirs["spec_decode_num_accepted_tokens"] / theirs["spec_decode_num_drafts"]
    print(f"{case}: first-position acceptance {here:.3f} here, {there:.3f} on vLLM; "
          f"tau {tau_here:.2f} here, {tau_there:.2f} on vLLM", file=sys.stderr)  # fmt: skip
    assert abs(here - there) <= 0.08 and abs(tau_here - tau_there) <= 0.15
