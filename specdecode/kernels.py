"""Optional x86 CPU kernels (AVX-512, or AVX2 + FMA) for small-batch (decode-time) inference.

The C++ source in ``csrc/specdecode_kernels.cpp`` is JIT-compiled on first
use with ``torch.utils.cpp_extension.load`` into a build cache
(``$SPECDECODE_CACHE`` or ``~/.cache/specdecode``).  Everything here is
optional: when the CPU has neither AVX-512 nor AVX2 + FMA, the compiler is missing, the build
fails, ``SPECDECODE_DISABLE_KERNELS=1`` is set, or tensors live on another
device, the functions fall back to plain torch with the same semantics.

Typical use::

    packed = kernels.pack(layer.weight, layer.bias, dtype=torch.bfloat16)
    y = kernels.linear(x, packed)          # y = x @ W^T + b, any M

Weights are stored fp32, bf16, int8 (per-row scales) or int4 (a scale per 128 k's); int8
and int4 serve drafters (`draft_dtype`: their proposals never touch exactness) and quantized
targets (`quantization`: another model, verified against itself).  On CPUs with AVX512_VNNI
both multiply int8-quantised activations with vpdpbusd (int4 needs it; int8 falls back to
weight-only, fp32 activations, without it or with ``SPECDECODE_INT8_DOT=0``).

The linear kernel targets M = 1..16 rows (it stays correct for larger M).
Every output row is computed in a fixed order that does not depend on M or
on the thread split, so results are bitwise batch-invariant.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

__all__ = [
    "PackedLinear",
    "available",
    "cpu_supported",
    "linear",
    "load_extension",
    "pack",
    "rmsnorm",
    "silu_mul",
]

CACHE_ENV = "SPECDECODE_CACHE"
DISABLE_ENV = "SPECDECODE_DISABLE_KERNELS"
_CSRC = Path(__file__).resolve().parent / "csrc"
_SOURCE = _CSRC / "specdecode_kernels.cpp"
_SOURCES = (_SOURCE, _CSRC / "decoder.cpp")
_EXT_NAME = "specdecode_kernels"
# One instruction set per build, the widest this CPU has (the C++ picks it from the macros that
# -march=native and these flags define); the packed weight layout is the same for both.
_ISA_FLAGS = {
    "avx512": ("avx512f", "avx512bw", "avx512vl", "avx512dq", "fma"),
    "avx2": ("avx2", "fma"),
}
_BF16_FLAG = "avx512_bf16"
_VNNI_FLAG = "avx512_vnni"
_AMX_FLAGS = frozenset({"amx_tile", "amx_bf16"})
AMX_ENV = "SPECDECODE_AMX"  # "0": keep bf16 projections on vdpbf16ps where AMX exists
PREFETCH_ENV = "SPECDECODE_PREFETCH"  # "0": no software prefetch of the weights at 2+ rows
_BLOCK = 16  # outputs per packed block, must match the C++ kBlock

_lock = threading.Lock()
_ext: ModuleType | None = None
_load_attempted = False


@functools.lru_cache(maxsize=1)
def _cpu_flags() -> frozenset[str]:
    """Return the CPU feature flags from /proc/cpuinfo (empty if unreadable)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_isa() -> str | None:
    """The instruction set the kernels are built for here: "avx512", "avx2" or None."""
    flags = _cpu_flags()
    if flags:
        for isa, required in _ISA_FLAGS.items():
            if all(f in flags for f in required):
                return isa
        return None
    try:  # no /proc/cpuinfo: trust torch's own dispatch level
        cap = torch.backends.cpu.get_cpu_capability()
    except Exception:  # pragma: no cover - very old torch
        return None
    return {"AVX512": "avx512", "AVX2": "avx2"}.get(cap)


def cpu_supported() -> bool:
    """Whether this CPU has an instruction set the kernels are built for."""
    return cpu_isa() is not None


def cpu_has_bf16_dot() -> bool:
    """Whether the CPU supports vdpbf16ps (needed for ``bf16_activations``)."""
    return _BF16_FLAG in _cpu_flags() and cpu_isa() == "avx512"


def cpu_has_int8_dot() -> bool:
    """Whether the CPU supports vpdpbusd (AVX512_VNNI): int8 weights then multiply int8-quantised
    activations (W8A8) instead of widening every weight to fp32."""
    return _VNNI_FLAG in _cpu_flags() and cpu_isa() == "avx512"


def cpu_has_amx() -> bool:
    """Whether the CPU has AMX tiles with bf16 products (Intel Sapphire Rapids and later)."""
    return _AMX_FLAGS <= _cpu_flags() and cpu_has_bf16_dot()


def amx_active() -> bool:
    """Whether bf16-activation projections with K a multiple of 32 run on AMX tiles here
    (compiled in, granted by the OS, not switched off with SPECDECODE_AMX=0)."""
    return available() and bool(_ext.amx_active())  # type: ignore[union-attr]


def int8_dot_enabled() -> bool:
    """Whether int8 weights multiply int8 activations (vpdpbusd: AVX512_VNNI, unless
    SPECDECODE_INT8_DOT=0); else they are weight-only, fp32 activations."""
    return (
        available()
        and bool(_ext.int8_dot_compiled())  # type: ignore[union-attr]
        and os.environ.get("SPECDECODE_INT8_DOT", "1") != "0"
    )


def int4_ready() -> bool:
    """Whether int4 weights run packed here (the int4 kernel needs vpdpbusd)."""
    return available() and bool(_ext.int8_dot_compiled())  # type: ignore[union-attr]


def cache_dir() -> Path:
    """Root folder of the JIT build cache."""
    root = os.environ.get(CACHE_ENV)
    return Path(root) if root else Path.home() / ".cache" / "specdecode"


def _build_dir() -> Path:
    """Build folder keyed by torch version and CPU features (-march=native)."""
    flags = " ".join(sorted(_cpu_flags()))
    tag = hashlib.sha256(f"{torch.__version__}|{flags}".encode()).hexdigest()[:12]
    return cache_dir() / "ext" / f"torch{torch.__version__.split('+')[0]}-{tag}"


# Loading holds `lock` in the build folder (torch's cpp_extension), for a moment, or for the
# build on first use, and another process waits without a word for as long as it is there. A
# process killed meanwhile (SIGTERM, SIGKILL: no cleanup) leaves it behind, and every later
# start would hang. A build takes seconds to a few minutes: a lock older than this is stale.
_STALE_LOCK_S = 900.0
_SAY_WAITING_S = 5.0  # a lock still there after this long is worth a word


def _clear_stale_lock(build_dir: Path) -> None:
    """Return once the build folder has no lock (waiting while another process builds), or
    remove a stale one."""
    lock, start, said = build_dir / "lock", time.monotonic(), False
    while True:
        try:
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:
            return
        if age > _STALE_LOCK_S:
            log.warning("removing a stale kernel build lock (%.0f min old): %s", age / 60, lock)
            lock.unlink(missing_ok=True)
            return
        if not said and time.monotonic() - start > _SAY_WAITING_S:
            log.warning(
                "waiting for another process building the specdecode kernels (%s; removed "
                "as stale after %.0f min; %s=1 runs without the kernels)",
                lock,
                _STALE_LOCK_S / 60,
                DISABLE_ENV,
            )
            said = True
        time.sleep(0.2)


def load_extension(verbose: bool = False) -> ModuleType | None:
    """Compile (first time) and import the extension; None if unavailable."""
    global _ext, _load_attempted
    if _load_attempted:
        return _ext
    with _lock:
        if _load_attempted:
            return _ext
        try:
            _ext = _compile(verbose)
            if _ext is not None and os.environ.get(AMX_ENV, "") == "0":
                _ext.set_amx(False)
            if _ext is not None and os.environ.get(PREFETCH_ENV, "") == "0":
                _ext.set_prefetch(False)
        finally:
            _load_attempted = True
    return _ext


def _compile(verbose: bool) -> ModuleType | None:
    if os.environ.get(DISABLE_ENV, "") not in ("", "0"):
        log.info("specdecode kernels disabled by %s", DISABLE_ENV)
        return None
    isa = cpu_isa()
    if isa is None:
        log.info("specdecode kernels unavailable: CPU has neither AVX-512 nor AVX2 + FMA")
        return None
    if not _SOURCE.is_file():
        log.warning("specdecode kernels unavailable: missing %s", _SOURCE)
        return None
    try:
        from torch.utils import cpp_extension

        build_dir = _build_dir()
        build_dir.mkdir(parents=True, exist_ok=True)
        cflags = ["-O3", "-march=native", "-fopenmp", "-DNDEBUG"]
        cflags += [f"-m{f.replace('_', '')}" for f in _ISA_FLAGS[isa]]
        if isa == "avx512" and cpu_has_bf16_dot():
            cflags.append("-mavx512bf16")
        if cpu_has_int8_dot():
            cflags.append("-mavx512vnni")
        if cpu_has_amx():
            cflags += ["-mamx-tile", "-mamx-bf16"]
            if "amx_int8" in _cpu_flags() and cpu_has_int8_dot():
                cflags.append("-mamx-int8")
        _clear_stale_lock(build_dir)
        if not any(build_dir.glob(f"{_EXT_NAME}*.so")):
            log.info("building specdecode kernels in %s (first use, ~15 s)", build_dir)
        start = time.perf_counter()
        ext = cpp_extension.load(
            name=_EXT_NAME,
            sources=[str(p) for p in _SOURCES],
            extra_include_paths=[str(_CSRC)],
            extra_cflags=cflags,
            extra_ldflags=["-fopenmp"],
            build_directory=str(build_dir),
            verbose=verbose,
        )
        elapsed = time.perf_counter() - start
        log.info("specdecode kernels (%s) loaded in %.1fs (%s)", isa, elapsed, build_dir)
        return ext
    except Exception as exc:  # compiler missing, build error, import error ...
        log.warning("specdecode kernels unavailable, falling back to torch: %s", exc)
        return None


def available() -> bool:
    """True if the compiled kernels can be used (compiles lazily on first call)."""
    return load_extension() is not None


@dataclass(frozen=True, slots=True)
class PackedLinear:
    """A linear layer's weight prepared for :func:`linear`.

    ``weight`` is the packed tensor when ``packed`` is True (see the C++ file
    for the layout), otherwise the plain ``[N, K]`` weight used by the torch
    fallback.  ``dtype`` is the storage dtype of the weight.
    """

    weight: torch.Tensor
    bias: torch.Tensor | None
    out_features: int
    in_features: int
    dtype: torch.dtype
    packed: bool
    bf16_activations: bool = False

    @property
    def nbytes(self) -> int:
        """Bytes of weight streamed per call."""
        return self.weight.numel() * self.weight.element_size()


def _pack_weight(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Reorder [N, K] into the blocked layout the C++ kernels stream."""
    n, k = weight.shape
    nb = -(-n // _BLOCK)
    if dtype == torch.int8:
        return _pack_int8(weight, nb)
    if dtype == torch.int4:
        return _pack_int4(weight, nb)
    if dtype == torch.float32:
        padded = weight.new_zeros((nb * _BLOCK, k), dtype=dtype)
        padded[:n] = weight
        # [nb, 16, K] -> [nb, K, 16]
        return padded.view(nb, _BLOCK, k).transpose(1, 2).contiguous()
    k2 = -(-k // 2)
    padded = weight.new_zeros((nb * _BLOCK, 2 * k2), dtype=dtype)
    padded[:n, :k] = weight
    # [g, 16, K/2, 2] -> [K/2, g, 16, 2]: one 32-bit lane = (k, k+1) of one output
    return _interleave_groups(padded, nb, 2, (0, 3, 1, 2, 4)).view(nb, k2, _BLOCK, 2)


def _interleave_groups(padded: torch.Tensor, nb: int, per: int, order: tuple) -> torch.Tensor:
    """Flat groups of g blocks (the last may be smaller), each [K/per, g, ...] per `order` from
    [groups, g, 16, K/per, per]: a micro-tile then streams one contiguous run (bf16, int8)."""
    ks = padded.shape[1] // per
    g = _ext.bf16_group()  # type: ignore[union-attr]  # 4 (AVX-512) or 2 (AVX2)
    full = nb - nb % g
    parts = []
    for start, count, size in ((0, full, g), (full, nb - full, nb - full)):
        if count:
            rows = padded[start * _BLOCK : (start + count) * _BLOCK]
            parts.append(rows.view(count // size, size, _BLOCK, ks, per).permute(order).reshape(-1))
    return torch.cat(parts)


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-row int8: (q [N, K] int8, scale [N] fp32), W ~ q * scale[:, None]."""
    w = weight.float()
    scale = (w.abs().amax(1) / 127.0).clamp_min(1e-12)
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def _pack_int8(weight: torch.Tensor, nb: int) -> torch.Tensor:
    """Groups of g blocks as [K/4, g, 4, 16] int8 (see the C++ file), then the fp32 scales; on
    CPUs with vpdpbusd the int8 dot layout instead: [K/4, g, 16, 4], the scales, then the int32
    row sums of q, in a uint8 tensor (the kernels dispatch on it)."""
    n, k = weight.shape
    q, scale = quantize_int8(weight)
    k4 = -(-k // 4)
    padded = torch.zeros((nb * _BLOCK, 4 * k4), dtype=torch.int8)
    padded[:n, :k] = q
    scales = torch.zeros(nb * _BLOCK, dtype=torch.float32)
    scales[:n] = scale
    if int8_dot_enabled():
        # [g, 16, K/4, 4] -> [K/4, g, 16, 4]: one 32-bit lane = 4 k's of one output
        blocks = _interleave_groups(padded, nb, 4, (0, 3, 1, 2, 4))
        sums = torch.zeros(nb * _BLOCK, dtype=torch.int32)
        sums[:n] = q.sum(1, dtype=torch.int32)
        parts = [blocks, scales.view(torch.int8), sums.view(torch.int8)]
        return torch.cat(parts).view(torch.uint8).view(nb, (k4 + 2) * 64)
    # [g, 16, K/4, 4] -> [K/4, g, 4, 16]: 16 outputs of one k per 16 bytes
    blocks = _interleave_groups(padded, nb, 4, (0, 3, 1, 4, 2))
    return torch.cat([blocks, scales.view(torch.int8)]).view(nb, (k4 + 1) * 64)


def quantize_int4(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int4 per output row and group of `group` k's (K zero-padded to whole groups):
    (q [N, Kp] int8 in [-8, 7], scale [N, Kp / group] fp32), W ~ q * scale per group."""
    n, k = weight.shape
    kp = -(-k // group) * group
    w = weight.new_zeros((n, kp), dtype=torch.float32)
    w[:, :k] = weight.float()
    w = w.view(n, kp // group, group)
    scale = (w.abs().amax(2) / 7.0).clamp_min(1e-12)
    q = torch.round(w / scale[..., None]).clamp_(-8, 7).to(torch.int8)
    return q.view(n, kp), scale


def dequantize_int4(q: torch.Tensor, scale: torch.Tensor, k: int) -> torch.Tensor:
    n, kp = q.shape
    w = q.float().view(n, scale.shape[1], -1) * scale[..., None]
    return w.view(n, kp)[:, :k]


def _pack_int4(weight: torch.Tensor, nb: int) -> torch.Tensor:
    """The int4 dot layout (see the C++ file) in an int16 tensor (the kernels dispatch on it)."""
    n, k = weight.shape
    group = _ext.int4_group()  # type: ignore[union-attr]
    q, scale = quantize_int4(weight, group)
    kp, ng, npad = q.shape[1], scale.shape[1], nb * _BLOCK
    u = torch.full((npad, kp), 8, dtype=torch.int32)  # u = q + 8; padded rows: q = 0
    u[:n] = q.int() + 8
    # byte h of step j: u[8 j + h] | u[8 j + 4 + h] << 4
    quads = u.view(npad, kp // 8, 2, 4)
    nibbles = (quads[:, :, 0] | (quads[:, :, 1] << 4)).to(torch.uint8).view(npad, kp // 2)
    blocks = _interleave_groups(nibbles.view(torch.int8), nb, 4, (0, 3, 1, 2, 4))
    scales = torch.zeros((ng, npad), dtype=torch.float32)
    scales[:, :n] = scale.T
    parts = [blocks, scales.reshape(-1).view(torch.int8)]
    return torch.cat(parts).view(torch.int16).view(nb, (kp // 8 + ng) * 32)


def pack(
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
    bf16_activations: bool = False,
) -> PackedLinear:
    """Prepare ``weight`` ([N, K]) and optional ``bias`` for :func:`linear`.

    ``dtype`` is the storage dtype (float32, bfloat16, or for drafters and quantized targets
    int8 (symmetric per row) or int4 (symmetric per row and 128 k's), which
    multiply int8-quantised activations on AVX512_VNNI CPUs; default: the weight's own when it
    is float32 or bfloat16, else float32).  With bf16 storage,
    activations stay fp32 unless ``bf16_activations`` is set, which rounds
    them to bf16 and uses vdpbf16ps (about 2x faster at M >= 8, ~1e-3 rel.
    error; ignored without AVX512_BF16).  Non-CPU weights, other dtypes and
    unavailable kernels give an unpacked object that :func:`linear` serves
    with ``F.linear`` (for bf16 storage that path runs in bf16).
    """
    if weight.dim() != 2 or weight.shape[1] == 0:
        raise ValueError(f"expected a 2-D weight with K > 0, got shape {tuple(weight.shape)}")
    if dtype is None:
        dtype = weight.dtype if weight.dtype in (torch.float32, torch.bfloat16) else torch.float32
    n, k = weight.shape
    weight = weight.detach()
    bias = bias.detach() if bias is not None else None
    if bf16_activations and not (dtype == torch.bfloat16 and cpu_has_bf16_dot()):
        log.debug("bf16_activations needs bf16 weights and AVX512_BF16; ignored")
        bf16_activations = False
    if dtype not in (torch.float32, torch.bfloat16, torch.int8, torch.int4):
        raise ValueError(f"unsupported packed dtype {dtype}")
    use_kernel = weight.device.type == "cpu" and available()
    if dtype == torch.int4 and not (use_kernel and _ext.int8_dot_compiled()):  # type: ignore[union-attr]
        q, scale = quantize_int4(weight, 128)  # no int4 kernel: the dequantised weight
        w = dequantize_int4(q, scale, k).to(weight.dtype)
        return PackedLinear(w.contiguous(), bias, n, k, w.dtype, packed=False)
    if not use_kernel:
        if dtype == torch.int8:  # no int8 kernel: keep the dequantised weight (same numbers)
            q, scale = quantize_int8(weight)
            w = (q.float() * scale[:, None]).to(weight.dtype)
        else:
            w = weight.to(dtype) if weight.device.type == "cpu" else weight
        return PackedLinear(w.contiguous(), bias, n, k, w.dtype, packed=False)
    with torch.no_grad():
        packed_w = _pack_weight(weight, dtype)
        b = bias.to(torch.float32).contiguous() if bias is not None else None
    return PackedLinear(packed_w, b, n, k, dtype, packed=True, bf16_activations=bf16_activations)


def linear(x: torch.Tensor, packed: PackedLinear, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W^T + b`` for ``x`` of shape [..., K]; output keeps ``x.dtype``.

    ``bias`` overrides the bias given to :func:`pack`.  Inference only: the
    kernel path does not record autograd history.
    """
    b = packed.bias if bias is None else bias
    if packed.packed:  # implies the extension is loaded
        if not (x.is_cpu and x.is_floating_point()):
            raise RuntimeError(
                f"packed weight used with an unsupported input ({x.device}, {x.dtype})"
            )
        return _ext.linear(  # type: ignore[union-attr]
            x,
            packed.weight,
            packed.out_features,
            packed.in_features,
            b,
            packed.bf16_activations,
        )
    w = packed.weight
    if w.dtype != x.dtype:
        y = F.linear(x.to(w.dtype), w, b.to(w.dtype) if b is not None else None)
        return y.to(x.dtype)
    return F.linear(x, w, b)


def _fused_ext(*tensors: torch.Tensor) -> ModuleType | None:
    """The extension if the fused fp32 CPU kernels can take these tensors."""
    for t in tensors:
        if not t.is_cpu or t.dtype != torch.float32:
            return None
    return _ext if _load_attempted else load_extension()


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate_up[..., :I]) * gate_up[..., I:]`` (fused on CPU fp32)."""
    ext = _fused_ext(gate_up)
    if ext is not None:
        return ext.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rmsnorm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """RMSNorm of ``x`` (HF Llama style); with ``residual``, first ``residual += x``.

    ``residual`` is updated in place and the returned tensor is the
    normalized sum, i.e. the usual ``residual = residual + h; h = norm(residual)``.
    Fused for fp32 CPU tensors, plain torch otherwise.
    """
    if residual is None:
        ext = _fused_ext(x, weight)
    elif residual.is_contiguous() and residual.shape == x.shape:
        ext = _fused_ext(x, weight, residual)
    else:
        ext = None
    if ext is not None:
        return ext.rmsnorm(x, weight, float(eps), residual)
    if residual is not None:
        residual.add_(x)
        x = residual
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)
