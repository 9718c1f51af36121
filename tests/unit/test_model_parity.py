"""Our decoder against transformers' own implementation, on tiny random models of every family."""

from __future__ import annotations

import pytest
import torch
from helpers import Runner

from specdecode.models.fast import accelerate
from specdecode.models.loader import load_model

ATOL = 1e-4


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


@pytest.fixture(scope="module", params=["eager", "fast"])
def ours_and_hf(tiny_family, request):
    """Our model on the eager PyTorch path and on the packed-kernel C++ fast path."""
    family, path, hf = tiny_family
    model = load_model(path).model
    if request.param == "fast":
        if not accelerate(model):
            pytest.skip("CPU kernels unavailable here")
    return model, hf


def test_prefill_logits_match_transformers(ours_and_hf):
    ours, hf = ours_and_hf
    ids = torch.randint(0, 128, (23,), generator=torch.Generator().manual_seed(1)).tolist()
    r = Runner(ours)
    (logits,) = r.feed([r.new_seq()], [ids])
    torch.testing.assert_close(logits, hf_logits(hf, ids), atol=ATOL, rtol=0)


def test_incremental_decoding_matches_full_forward(ours_and_hf):
    ours, hf = ours_and_hf
    ids = list(range(3, 40))
    r = Runner(ours)
    s = r.new_seq()
    got = [r.feed([s], [ids[:10]])[0]]
    for t in ids[10:]:
        got.append(r.feed([s], [[t]])[0])
    torch.testing.assert_close(torch.cat(got), hf_logits(hf, ids), atol=ATOL, rtol=0)


def test_batched_ragged_equals_single(ours_and_hf):
    """Sequences of different lengths, prefill and decode mixed in one forward."""
    ours, hf = ours_and_hf
    r = Runner(ours)
    a, b = r.new_seq(), r.new_seq()
    ids_a, ids_b = list(range(5, 20)), list(range(50, 57))
    r.feed([a], [ids_a[:-1]])
    la, lb = r.feed([a, b], [ids_a[-1:], ids_b])
    torch.testing.assert_close(la[0], hf_logits(hf, ids_a)[-1], atol=ATOL, rtol=0)
    torch.testing.assert_close(lb, hf_logits(hf, ids_b), atol=ATOL, rtol=0)


def test_captured_layer_inputs_match_hf_hidden_states(ours_and_hf):
    ours, hf = ours_and_hf
    ids = list(range(7, 30))
    r = Runner(ours)
    # a layer asked for twice is captured twice, on both paths (a feature layout is positional)
    capture = (0, 1, 1, 2)  # 2 = N: the last layer's output, before the final norm
    _, out = r.feed([r.new_seq()], [ids], capture=capture)
    with torch.no_grad():
        hs = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states
    # hidden_states[i] is the input of layer i; the last entry has the final norm applied.
    assert len(out.captured) == len(capture)
    for k, layer in enumerate(capture[:-1]):
        torch.testing.assert_close(out.captured[k], hs[layer][0], atol=ATOL, rtol=0)
    torch.testing.assert_close(out.hidden, hs[-1][0], atol=ATOL, rtol=0)
    last = out.captured[-1]
    assert not torch.allclose(last, out.hidden, atol=1e-2)  # (before the norm)
    with torch.no_grad():
        torch.testing.assert_close(hf.model.norm(last), out.hidden, atol=ATOL, rtol=0)
    if ours.fast is None:  # the training forward captures it too
        with torch.no_grad():
            dense = ours.forward_dense(torch.tensor([ids]), capture_layers=(0, 2))
        torch.testing.assert_close(dense.captured[1][0], last, atol=ATOL, rtol=0)


def test_dense_forward_matches_transformers(ours_and_hf):
    """The cache-free training forward, on a right-padded batch (eager models only)."""
    ours, hf = ours_and_hf
    if ours.fast is not None:
        pytest.skip("training uses the eager model")
    a, b = list(range(3, 20)), list(range(40, 50))
    ids = torch.tensor([a, b + [0] * (len(a) - len(b))])
    out = ours.forward_dense(ids)
    logits = ours.compute_logits(out.hidden)
    torch.testing.assert_close(logits[0], hf_logits(hf, a), atol=ATOL, rtol=0)
    torch.testing.assert_close(logits[1, : len(b)], hf_logits(hf, b), atol=ATOL, rtol=0)


def test_bf16_fast_path_stays_close(tiny_family):
    """bf16 weights on the fast path (vdpbf16ps with bf16-rounded inputs where the CPU has it):
    logits close to the fp32 reference, and a row's projections independent of the batch, so
    one decoded token equals the same token inside a 4-token forward up to attention order."""
    from specdecode import kernels

    family, path, hf = tiny_family
    model = load_model(path, dtype=torch.bfloat16).model
    if not accelerate(model):
        pytest.skip("CPU kernels unavailable here")
    assert model.fast.bf16_activations == kernels.cpu_has_bf16_dot()
    ids = torch.randint(0, 128, (12,), generator=torch.Generator().manual_seed(3)).tolist()
    r = Runner(model)
    seq = r.new_seq()
    (logits,) = r.feed([seq], [ids])
    ref = hf_logits(hf, ids)
    assert (logits - ref).abs().max() / ref.abs().max() < 0.05
    one = r.feed([seq], [[7]])[0][-1]
    r2 = Runner(model)
    s2 = r2.new_seq()
    r2.feed([s2], [ids])
    four = r2.feed([s2], [[7, 8, 9, 10]])[0][0]
    torch.testing.assert_close(one, four, atol=1e-3, rtol=0)
