"""Benchmarks: `specdecode bench latency | serve | suite | structured`."""

from __future__ import annotations

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
    return f"{cpu}{extensions}, {torch.get_num_threads()} threads, torch {torch.__version__}"
