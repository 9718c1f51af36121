"""The packed small-M linear kernels and fused ops against torch, and every fallback."""

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from specdecode import kernels

pytestmark = pytest.mark.skipif(not kernels.available(), reason="kernels unavailable")


def rel(a, r):
    return ((a.double() - r.double()).abs().max() / r.double().abs().max()).item()


@pytest.mark.parametrize("N,K", [(100, 71), (960, 576), (576, 1536), (33, 8)])
@pytest.mark.parametrize("M", [1, 2, 3, 5, 8, 13, 16, 17, 40])
def test_linear(N, K, M):
    torch.manual_seed(N * 1000 + K + M)
    W, b, x = torch.randn(N, K), torch.randn(N), torch.randn(M, K)
    p32 = kernels.pack(W, b)
    pbf = kernels.pack(W, b, dtype=torch.bfloat16)
    pdot = kernels.pack(W, b, dtype=torch.bfloat16, bf16_activations=True)
    assert p32.packed and pbf.packed and pdot.packed
    ref = F.linear(x.double(), W.double(), b.double())
    Wb = W.bfloat16().double()
    assert rel(kernels.linear(x, p32), ref) < 1e-5
    yb = kernels.linear(x, pbf)
    assert rel(yb, F.linear(x.double(), Wb, b.double())) < 1e-5
    # fp32-activation bf16 path == fp32 kernel on bf16-rounded weights, bitwise
    assert torch.equal(yb, kernels.linear(x, kernels.pack(W.bfloat16().float(), b)))
    yd = kernels.linear(x, pdot)
    if kernels.cpu_has_bf16_dot():
        assert pdot.bf16_activations
        assert rel(yd, F.linear(x.bfloat16().double(), Wb, b.double())) < 1e-5
    else:  # no vdpbf16ps (e.g. AVX2): the request is ignored, activations stay fp32
        assert not pdot.bf16_activations and torch.equal(yd, yb)
    for p in (p32, pbf, pdot):  # batch invariance
        y = kernels.linear(x, p)
        for i in {0, M // 2, M - 1}:
            assert torch.equal(kernels.linear(x[i : i + 1], p)[0], y[i])


@pytest.mark.skipif(not kernels.amx_active(), reason="no AMX-BF16 here")
@pytest.mark.parametrize("N,K", [(70, 64), (960, 576), (100, 96)])
@pytest.mark.parametrize("M", [1, 3, 16, 17, 40])
def test_linear_amx_against_vdpbf16ps(N, K, M):
    """On AMX CPUs bf16-activation projections with K % 32 == 0 run on tiles; both paths
    match the bf16-rounded reference, and the AMX rows are batch invariant (the last group
    short of 4 blocks, rows past 16 padded)."""
    ext = kernels.load_extension()
    torch.manual_seed(N + K + M)
    W, b, x = torch.randn(N, K), torch.randn(N), torch.randn(M, K)
    p = kernels.pack(W, b, dtype=torch.bfloat16, bf16_activations=True)
    ref = F.linear(x.bfloat16().double(), W.bfloat16().double(), b.double())
    try:
        ext.set_amx(False)
        y_dot = kernels.linear(x, p)
    finally:
        ext.set_amx(True)
    y_amx = kernels.linear(x, p)
    assert rel(y_dot, ref) < 1e-5 and rel(y_amx, ref) < 1e-5
    rows = torch.cat([kernels.linear(x[i : i + 1], p) for i in range(M)])
    assert torch.equal(rows, y_amx)
    # activations are rounded to bf16 on the way in: bf16 inputs give the same rows
    assert torch.equal(kernels.linear(x.bfloat16(), p), y_amx.bfloat16())


@pytest.mark.skipif(not kernels.amx_active(), reason="no AMX here")
@pytest.mark.parametrize("dtype", [torch.int8, torch.int4])
@pytest.mark.parametrize("N,K", [(70, 128), (100, 256), (200, 896)])
@pytest.mark.parametrize("M", [1, 3, 16, 17, 40])
def test_quantized_amx_matches_vpdpbusd_bitwise(dtype, N, K, M):
    """int8 (TDPBUSD) and int4 (unpacked nibbles, TDPBSUD) tiles sum the same exact int32s and
    scale them in the same order as the vpdpbusd kernels: the same bits, whatever the rows."""
    if dtype == torch.int8 and not kernels.cpu_has_int8_dot():
        pytest.skip("no AVX512_VNNI")
    ext = kernels.load_extension()
    torch.manual_seed(N + K + M)
    W, b, x = torch.randn(N, K) * 0.05, torch.randn(N), torch.randn(M, K)
    p = kernels.pack(W, b, dtype=dtype)
    before = ext.set_amx_rows(1, 1)  # AMX at every M
    try:
        y_amx = kernels.linear(x, p)
        ext.set_amx(False)
        y_dot = kernels.linear(x, p)
    finally:
        ext.set_amx(True)
        ext.set_amx_rows(*before)
    assert torch.equal(y_amx, y_dot)


def test_amx_env_switch_off(tmp_path):
    """SPECDECODE_AMX=0 keeps the vdpbf16ps path (A/B measurements)."""
    code = "from specdecode import kernels; print(kernels.amx_active())"
    env = dict(os.environ, SPECDECODE_AMX="0")
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip().splitlines()[-1] == "False"


def quantized_rows(x: torch.Tensor) -> torch.Tensor:
    """x as the int8 dot kernels see it: per row round(x / s) * s, s = max|x| / 127."""
    s = x.double().abs().amax(1, keepdim=True) / 127
    return torch.round(x.double() / s) * s


@pytest.mark.parametrize("N,K", [(100, 71), (960, 576), (33, 8), (50, 5)])
@pytest.mark.parametrize("M", [1, 2, 5, 6, 7, 13])
@pytest.mark.parametrize("dot", [False, True])
def test_linear_int8(N, K, M, dot, monkeypatch):
    """int8 weights: the kernel equals the dequantised weight times x (weight-only) or times x
    quantised per row (vpdpbusd, AVX512_VNNI), whatever the batch."""
    ext = kernels.load_extension()
    if dot and not ext.int8_dot_compiled():
        pytest.skip("no AVX512_VNNI")
    monkeypatch.setenv("SPECDECODE_INT8_DOT", "1" if dot else "0")
    torch.manual_seed(N + K + M)
    W, b, x = torch.randn(N, K), torch.randn(N), torch.randn(M, K)
    p = kernels.pack(W, b, dtype=torch.int8)
    assert p.packed and p.dtype == torch.int8
    assert p.weight.dtype == (torch.uint8 if dot else torch.int8)  # the layout's tag
    q, scale = kernels.quantize_int8(W)
    assert q.abs().max() <= 127 and rel(q.double() * scale[:, None].double(), W) < 0.01
    y = kernels.linear(x, p)
    xr = quantized_rows(x) if dot else x.double()
    assert rel(y, F.linear(xr, q.double() * scale[:, None].double(), b.double())) < 1e-5
    for i in {0, M - 1}:
        assert torch.equal(kernels.linear(x[i : i + 1], p)[0], y[i])


@pytest.mark.parametrize("N,K", [(100, 71), (960, 576), (33, 8), (70, 300)])
@pytest.mark.parametrize("M", [1, 2, 3, 7])
def test_linear_int4(N, K, M):
    """int4 weights (a scale per 128 k's) times x quantised per row, whatever the batch."""
    if not kernels.int4_ready():
        pytest.skip("no AVX512_VNNI")
    torch.manual_seed(N + K + M)
    W, b, x = torch.randn(N, K), torch.randn(N), torch.randn(M, K)
    p = kernels.pack(W, b, dtype=torch.int4)
    assert p.packed and p.dtype == torch.int4 and p.weight.dtype == torch.int16
    q, scale = kernels.quantize_int4(W, 128)
    assert q.min() >= -8 and q.max() <= 7 and q.shape[1] % 128 == 0
    Wd = kernels.dequantize_int4(q, scale, K).double()
    assert rel(Wd, W) < 0.1
    y = kernels.linear(x, p)
    assert rel(y, F.linear(quantized_rows(x), Wd, b.double())) < 1e-5
    for i in {0, M - 1}:
        assert torch.equal(kernels.linear(x[i : i + 1], p)[0], y[i])


def test_int4_without_kernels_runs_the_dequantised_weight(monkeypatch):
    W, x = torch.randn(40, 200), torch.randn(3, 200)
    monkeypatch.setattr(kernels, "available", lambda: False)
    p = kernels.pack(W, dtype=torch.int4)
    assert not p.packed and p.weight.dtype == torch.float32
    q, scale = kernels.quantize_int4(W, 128)
    assert torch.equal(p.weight, kernels.dequantize_int4(q, scale, 200))
    assert torch.allclose(kernels.linear(x, p), x @ p.weight.T)


def test_int8_without_kernels_runs_the_dequantised_weight(monkeypatch):
    monkeypatch.setenv("SPECDECODE_INT8_DOT", "0")  # weight-only: the same numbers as torch
    W, x = torch.randn(40, 24), torch.randn(3, 24)
    packed = kernels.linear(x, kernels.pack(W, dtype=torch.int8))
    monkeypatch.setattr(kernels, "available", lambda: False)
    p = kernels.pack(W, dtype=torch.int8)
    assert not p.packed and p.weight.dtype == torch.float32
    q, scale = kernels.quantize_int8(W)
    assert torch.equal(p.weight, q.float() * scale[:, None])
    assert rel(kernels.linear(x, p), packed) < 1e-5
    with pytest.raises(ValueError, match="unsupported packed dtype"):
        kernels.pack(W, dtype=torch.float16)


def test_linear_shapes_dtypes():
    W = torch.randn(64, 32)
    x = torch.randn(2, 3, 32)
    p = kernels.pack(W)
    assert kernels.linear(x, p).shape == (2, 3, 64)
    xb = x.bfloat16()
    y = kernels.linear(xb, p)
    assert y.dtype == torch.bfloat16 and rel(y, F.linear(xb.float(), W)) < 1e-2
    bias2 = torch.randn(64)
    assert rel(kernels.linear(x, p, bias2), F.linear(x, W, bias2)) < 1e-5
    assert kernels.linear(torch.randn(0, 32), p).shape == (0, 64)


def test_fallback_non_cpu():
    W = torch.randn(16, 8, device="meta")
    p = kernels.pack(W)
    assert not p.packed
    assert kernels.linear(torch.randn(2, 8, device="meta"), p).shape == (2, 16)


def test_silu_mul():
    for shape in [(1, 2 * 1536), (5, 2 * 17), (3, 4, 2 * 64)]:
        gu = torch.randn(*shape) * 8
        g, u = gu.chunk(2, -1)
        assert rel(kernels.silu_mul(gu), F.silu(g) * u) < 1e-6
    gu = torch.tensor([[-1e4, 1e4, float("inf"), -float("inf"), 0.0, 1, 1, 1, 1, 1]])
    out = kernels.silu_mul(gu)
    assert torch.allclose(out, F.silu(gu[:, :5]) * gu[:, 5:], equal_nan=True)


def test_rmsnorm():
    for H in (576, 37):
        x, r, w = torch.randn(3, H), torch.randn(3, H), torch.randn(H)

        def ref(h, w=w):
            return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5))

        assert rel(kernels.rmsnorm(x, w, 1e-5), ref(x)) < 1e-5
        r2 = r.clone()
        out = kernels.rmsnorm(x, w, 1e-5, residual=r2)
        assert torch.equal(r2, r + x)
        assert rel(out, ref(r + x)) < 1e-5


def test_disabled_env_falls_back(tmp_path):
    code = (
        "import torch; from specdecode import kernels;"
        "assert not kernels.available(); p=kernels.pack(torch.randn(4,3)); assert not p.packed;"
        "print(kernels.linear(torch.randn(2,3), p).shape)"
    )
    env = dict(os.environ, SPECDECODE_DISABLE_KERNELS="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_compile_error_falls_back(tmp_path, monkeypatch):
    bad = tmp_path / "bad.cpp"
    bad.write_text("this is not C++")
    monkeypatch.setattr(kernels, "_SOURCE", bad)
    monkeypatch.setattr(kernels, "_SOURCES", (bad,))
    monkeypatch.setattr(kernels, "_EXT_NAME", "specdecode_bad")
    monkeypatch.setenv(kernels.CACHE_ENV, str(tmp_path / "cache"))
    assert kernels._compile(False) is None


def test_instruction_set_choice(monkeypatch):
    for flags, isa in [
        ({"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq"}, "avx512"),
        ({"avx2", "fma", "avx512f"}, "avx2"),  # an incomplete AVX-512 set
        ({"sse2", "avx2", "fma"}, "avx2"),
        ({"avx2", "fma", "avx512_bf16"}, "avx2"),
    ]:
        monkeypatch.setattr(kernels, "_cpu_flags", lambda f=frozenset(flags): f)
        assert kernels.cpu_isa() == isa and kernels.cpu_supported()
        # vdpbf16ps is used only from the AVX-512 build
        assert kernels.cpu_has_bf16_dot() == ("avx512_bf16" in flags and isa == "avx512")


def test_cpu_without_avx2_fma_falls_back(monkeypatch):
    monkeypatch.setattr(kernels, "_cpu_flags", lambda: frozenset({"sse2", "avx2"}))
    assert kernels.cpu_isa() is None and not kernels.cpu_supported()
    assert kernels._compile(False) is None


@pytest.mark.parametrize("dtype", [torch.int8, torch.int4])
def test_quantized_activations_keep_nan_rows_apart(dtype):
    """A row with NaN or inf gives no finite output (NaN with quantised activations), the other
    rows are untouched."""
    if dtype == torch.int4 and not kernels.int4_ready():
        pytest.skip("no AVX512_VNNI")
    W, x = torch.randn(40, 300), torch.randn(3, 300)
    p = kernels.pack(W, dtype=dtype)
    clean = kernels.linear(x[1:2], p)
    x[0, 5], x[2, 299] = float("nan"), float("inf")
    y = kernels.linear(x, p)
    assert not y[0].isfinite().any() and not y[2].isfinite().any()
    assert torch.equal(y[1:2], clean)


def test_int4_is_not_accelerated_where_it_cannot_be_packed(monkeypatch, tiny_llama_dir):
    """Unpacked int4 weights must not reach the layer loop (it reads packed ones only): on a
    CPU without the int4 kernel the model stays on the eager path, with its weights."""
    from specdecode.models.fast import accelerate, can_accelerate
    from specdecode.models.loader import load_model

    model = load_model(tiny_llama_dir).model
    if not can_accelerate(model):
        pytest.skip("no CPU kernels here")
    monkeypatch.setattr(kernels, "int4_ready", lambda: False)
    assert accelerate(model, torch.int4) is False and model.fast is None
    assert model.layers[0].self_attn.qkv_proj.weight.numel() > 0  # not freed
