"""Run by tests/compat/test_vllm_serving.py with a Python that has vLLM (CPU build), not the
project's: greedy generation on vLLM from token ids, with or without a speculative config, and
vLLM's own speculative-decoding counters. Reads one JSON request from argv[1], writes the
result as JSON to argv[2]."""

import json
import os
import sys


def main() -> None:
    req = json.loads(open(sys.argv[1]).read())
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # one process: simpler, enough
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB
    from vllm import LLM, SamplingParams

    kwargs = dict(
        model=req["model"],
        dtype="float32",
        max_model_len=req.get("max_model_len", 2048),
        enforce_eager=True,
        disable_log_stats=False,
        seed=0,
    )
    if req.get("speculative_config"):
        kwargs["speculative_config"] = req["speculative_config"]
    llm = LLM(**kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=req["max_tokens"], ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": ids} for ids in req["prompts"]], params)
    result = {"tokens": [list(o.outputs[0].token_ids) for o in outs]}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:spec_decode"):
            result[m.name.removeprefix("vllm:")] = m.values if hasattr(m, "values") else m.value
    with open(sys.argv[2], "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
