"""`specdecode bench latency`: batch-1 plain decoding, specdecode vs transformers `generate`.

Both engines decode the same prompts greedily in the same dtype (a quantized target,
`--quantization`, against transformers on the unquantized weights). Decode speed is measured as
(N - 1) / (t(N tokens) - t(1 token)), which removes the prefill from both sides the same way. The
floor is the time to stream every weight the step reads once, at the memory bandwidth measured
here in the same run.
"""

from __future__ import annotations

import argparse
import json
import logging
import time

import torch

from specdecode.bench import machine

log = logging.getLogger(__name__)

PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a hash map works, with an example in Python.",
    "List five tips for staying focused while studying.",
]


def measure_bandwidth(gib: float = 0.5, buffers: int = 4, repeats: int = 4) -> float:
    """Read bandwidth in bytes/s: the best over fresh buffers (on this VM the speed of a buffer
    depends on where it lands, by up to 1.5x), repeats and methods of streaming memory much
    larger than the caches: torch's reductions and (when built) the packed linear kernel. The
    best any code reaches here is the honest floor."""
    best = 0.0
    for _ in range(buffers):
        best = max(best, _bandwidth_of_one_buffer(int(gib * 2**30) // 4, repeats))
    return best


def _bandwidth_of_one_buffer(numel: int, repeats: int) -> float:
    from specdecode import kernels

    x = torch.ones(numel, dtype=torch.float32)
    runs = [(x.numel() * 4, lambda: x.sum()), (x.numel() * 4, lambda: torch.dot(x, x))]
    if kernels.available():
        for n, k in ((3072, 576), (1536, 8960)):
            per = n * k
            packs = [
                kernels.pack(x[i * per : (i + 1) * per].view(n, k), dtype=torch.float32)
                for i in range(x.numel() // per)
            ]
            v = torch.ones(1, k)
            runs.append(
                (
                    len(packs) * per * 4,
                    lambda packs=packs, v=v: [kernels.linear(v, p) for p in packs],
                )
            )
    best = 0.0
    for nbytes, fn in runs:
        fn()
        for _ in range(repeats):
            t = time.perf_counter()
            fn()
            best = max(best, nbytes / (time.perf_counter() - t))
    return best


def streamed_weight_bytes(config, dtype: torch.dtype, quantization: str | None = None) -> int:
    """Bytes of every matrix a decode step multiplies by: each layer's projections and the LM
    head (norms and biases are negligible; the embedding row lookup is one row), stored in
    `dtype`, or as `quantization` packs them (int8: a byte a weight, int4: half; their per-row
    row scales are negligible; int4's, one per 128 weights, are counted)."""
    c = config
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    per_layer = (
        c.hidden_size * (q + 2 * kv) + q * c.hidden_size + 3 * c.hidden_size * (c.intermediate_size)
    )
    params = c.num_layers * per_layer + c.vocab_size * c.hidden_size
    if quantization is not None:  # (int4: a 4-byte scale per 128 weights besides)
        return int(params * {"int8": 1, "int4": 0.5 + 4 / 128}[quantization])
    return params * torch.empty((), dtype=dtype).element_size()


def _decode_rate(generate, prompt_ids: list[int], n: int, repeats: int) -> float:
    """tok/s of decoding alone: best over repeats of (n - 1) / (t(n) - t(1))."""
    generate(prompt_ids, 2)  # warm-up
    best = 0.0
    for _ in range(repeats):
        t = time.perf_counter()
        generate(prompt_ids, 1)
        t1 = time.perf_counter() - t
        t = time.perf_counter()
        generate(prompt_ids, n)
        tn = time.perf_counter() - t
        best = max(best, (n - 1) / max(tn - t1, 1e-9))
    return best


def greedy_decoder(llm):
    """`generate(prompt ids, n)`: n tokens of greedy decoding (past EOS), as `_decode_rate`
    times them."""
    from specdecode import SamplingParams

    def generate(ids: list[int], n: int) -> None:
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        llm.generate({"prompt_token_ids": ids}, params)

    return generate


def run_latency(args: argparse.Namespace) -> dict:
    from specdecode import LLM
    from specdecode.cli import engine_kwargs

    llm = LLM(args.model, **engine_kwargs(args))
    tok = llm.get_tokenizer()
    prompts = [llm._chat_ids([{"role": "user", "content": p}]) for p in PROMPTS]

    ours = greedy_decoder(llm)

    # The floor takes the best bandwidth read just before and just after specdecode's own run:
    # on a shared VM the reading moves with the neighbours (seen: 32-56 GB/s between runs), and
    # one low reading would flatter the share of the floor. It is the CPU's memory: on a GPU
    # there is no floor measured here.
    on_cpu = llm.engine.runner.device.type == "cpu"
    before = measure_bandwidth() if on_cpu else 0.0
    rates = {"specdecode": [_decode_rate(ours, p, args.max_tokens, args.repeats) for p in prompts]}
    bandwidth = max(before, measure_bandwidth()) if on_cpu else 0.0
    if not args.skip_transformers:
        hf_generate = _hf_generator(llm, tok)
        rates["transformers"] = [
            _decode_rate(hf_generate, p, args.max_tokens, args.repeats) for p in prompts
        ]
    from specdecode.engine.engine import resolve_dtype

    quantization = llm.engine.config.quantization
    weight_bytes = streamed_weight_bytes(
        llm.engine.model_config, resolve_dtype(args.dtype), quantization
    )
    result = {
        "model": str(llm.engine.model_path.name),
        "dtype": args.dtype,
        "quantization": quantization,
        "machine": machine(),
        "max_tokens": args.max_tokens,
        "tok_s": {k: sum(v) / len(v) for k, v in rates.items()},
        "per_prompt_tok_s": rates,
        "weight_mb": weight_bytes / 1e6,
    }
    ours_rate = result["tok_s"]["specdecode"]
    if on_cpu:
        floor_s = weight_bytes / bandwidth
        result["bandwidth_gb_s"] = bandwidth / 1e9
        result["floor_ms_per_token"] = floor_s * 1e3
        result["floor_tok_s"] = 1 / floor_s
        result["fraction_of_floor"] = ours_rate * floor_s
    if "transformers" in result["tok_s"]:
        result["speedup_vs_transformers"] = ours_rate / result["tok_s"]["transformers"]
    _print(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


def _hf_generator(llm, tok):
    import transformers
    from transformers import AutoModelForCausalLM

    from specdecode.engine.engine import resolve_dtype

    dtype = resolve_dtype(llm.engine.config.dtype)
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    hf = AutoModelForCausalLM.from_pretrained(str(llm.engine.model_path), dtype=dtype)
    hf = hf.to(llm.engine.runner.device).eval()  # (on the engine's device: a fair baseline)

    @torch.inference_mode()
    def generate(ids: list[int], n: int) -> None:
        x = torch.tensor([ids], device=hf.device)
        hf.generate(
            x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=tok.eos_token_id,
        )
        if x.is_cuda:
            torch.cuda.synchronize(x.device)

    return generate


def _print(r: dict) -> None:
    quantized = f"  quantization {r['quantization']}" if r.get("quantization") else ""
    print(f"model {r['model']}  dtype {r['dtype']}{quantized}  {r['machine']}")
    print(f"decode tok/s at batch 1, greedy, {r['max_tokens']} tokens, mean of prompts:")
    for name, rate in r["tok_s"].items():
        print(f"  {name:<14} {rate:7.1f} tok/s  ({1e3 / rate:6.1f} ms/token)")
    if "speedup_vs_transformers" in r:
        print(f"  speedup vs transformers: {r['speedup_vs_transformers']:.2f}x")
    if "floor_tok_s" in r:
        print(
            f"floor: {r['weight_mb']:.0f} MB of weights at {r['bandwidth_gb_s']:.1f} GB/s "
            f"measured = {r['floor_ms_per_token']:.1f} ms/token ({r['floor_tok_s']:.0f} tok/s); "
            f"specdecode reaches {100 * r['fraction_of_floor']:.0f}% of it"
        )
