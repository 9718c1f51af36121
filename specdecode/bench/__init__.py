"""Benchmarks: `specdecode bench latency | serve | http | suite | structured | prefix | report`."""

from __future__ import annotations

import argparse
import json
import platform

import torch


def machine() -> str:
    """What a measurement ran on: the CPU model, the instruction-set extensions the kernels use
    here (which decide the fast paths), threads and torch."""
    from specdecode import kernels

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
    except (OSError, StopIteration):
        pass
    isa = kernels.cpu_isa()
    features = [{"avx512": "AVX-512", "avx2": "AVX2"}[isa]] if isa else []
    features += [
        name
        for name, has in (
            ("AVX512_BF16", kernels.cpu_has_bf16_dot()),
            ("AVX512_VNNI", kernels.cpu_has_int8_dot()),
            ("AMX", kernels.cpu_has_amx()),
        )
        if has
    ]
    extensions = f" ({', '.join(features)})" if features else ""
    gpus = ""
    if torch.cuda.is_available():  # (the engine's device, where it runs on one)
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        gpus = f", GPU {', '.join(names)}"
    return f"{cpu}{extensions}, {torch.get_num_threads()} threads{gpus}, torch {torch.__version__}"


# ---- argument types: bad values are usage errors when the command starts, not tracebacks
# after minutes of measurement (numbers and output paths: specdecode.argtypes)

from specdecode.argtypes import (  # noqa: E402, F401
    at_least,
    name_list,
    number,
    output_dir,
    output_file,
    temperature,
)
from specdecode.argtypes import temperature_list as temperatures  # noqa: E402, F401


def level_list(text: str) -> str:
    """A comma list of concurrency levels >= 1 (kept as text; an empty one skips a sweep)."""
    try:
        values = [int(c) for c in text.split(",") if c.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"a comma list of integers, got {text!r}") from None
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"levels must be >= 1, got {text!r}")
    return ",".join(map(str, values))  # "1, 4," reads as "1,4"


def config_list(text: str) -> str:
    """A JSON list of speculative configs (objects); kept as text, parsed where used."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e.msg})") from None
    if not isinstance(value, list) or not all(isinstance(c, dict) for c in value):
        raise argparse.ArgumentTypeError("a JSON list of speculative configs (objects)")
    return text


def workload_list(text: str) -> str:
    """A comma list of workload names (spaces dropped: "code, sql" reads as "code,sql")."""
    from specdecode.bench.workloads import WORKLOADS

    return name_list(tuple(WORKLOADS), "workload")(text)
