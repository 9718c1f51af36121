"""EAGLE-3 heads against vLLM's `speculators` library itself (its model code, not a layout we
fabricated): a head exported here computes in speculators' Eagle3DraftModel what it computes
here, over several training-time-test steps; a checkpoint speculators writes loads here and
computes the same. Every variant of its config (norm_before_residual, norm_before_fc, fc_norm,
norm_output). Opt-in: `make compat` builds an environment with speculators; without it these
tests are skipped."""

from __future__ import annotations

import pytest
import torch

speculators = pytest.importorskip("speculators")
from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig  # noqa: E402

from specdecode.export import export_head  # noqa: E402
from specdecode.models.head_io import load_head, save_head  # noqa: E402
from specdecode.models.heads import Eagle3Head  # noqa: E402
from specdecode.models.loader import load_model  # noqa: E402

VARIANTS = [
    {},
    {"norm_before_residual": True},
    {"norm_before_fc": True},
    {"fc_norm": True},
    {"norm_output": True},
    {"norm_before_fc": True, "norm_output": True, "norm_before_residual": True},
]
STEPS = 3


@pytest.fixture(scope="module")
def target(tiny_llama_dir):
    return load_model(tiny_llama_dir, torch.float32).model


def _randomise(module, seed):
    """bf16-exact random weights (exports are bf16), norms away from 1."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "embed_tokens" in name:
                continue
            r = torch.randn(p.shape, generator=g)
            value = 1 + 0.3 * r if "norm" in name else 0.2 * r
            p.copy_(value.to(torch.bfloat16).float())


def _ours(target, variant, vocab):
    head = Eagle3Head(target.config, vocab.numel())
    head.set_variant(**variant)
    _randomise(head, 1)
    head.attach(target.embed_tokens, vocab)
    return head.eval()


def _theirs(path, target):
    cfg = Eagle3SpeculatorConfig.from_pretrained(path)
    cfg.transformer_layer_config._attn_implementation = "eager"  # (flex needs block sizes)
    model = Eagle3DraftModel.from_pretrained(path, config=cfg, torch_dtype=torch.float32)
    with torch.no_grad():  # the target's own embeddings, not their bf16 copy in the export
        model.embed_tokens.weight.copy_(target.embed_tokens.weight)
    return model.float().eval()


def _compare(ours, theirs, target):
    """Logits of STEPS unrolled draft steps at every position, both implementations."""
    t = 10
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, target.config.vocab_size, (1, t + STEPS), generator=g)
    feats = torch.randn(1, t, ours.feature_size, generator=g) * 2
    captured = []
    hook = theirs.lm_head.register_forward_hook(lambda m, i, o: captured.append(o.detach()))
    with torch.no_grad():
        mine = [ours.logits(p[0]) for p in ours.forward_unrolled(ids, feats, STEPS)]
        theirs(
            hidden_states=feats,
            input_ids=ids[:, :t],
            document_ids=torch.zeros(1, t, dtype=torch.long),
            position_ids=torch.arange(t)[None],
            ttt_steps=STEPS,
        )
    hook.remove()
    assert len(captured) == STEPS
    for j in range(STEPS):
        n = t - j  # speculators pads a later step's last ids with zeros: compare the rest
        torch.testing.assert_close(mine[j][:n], captured[j][0, :n].float(), atol=1e-4, rtol=1e-4)
    return mine


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "+".join(v) or "plain")
def test_an_exported_head_computes_the_same_in_speculators(
    target, tiny_llama_dir, tmp_path, variant
):
    vocab = torch.tensor([0, 3, 5, 9, 17, 33, 65, 100, 127])
    head = _ours(target, variant, vocab)
    save_head(head, tmp_path / "head", target.config, {})
    export_head(tmp_path / "head", target, "speculators", tmp_path / "out", str(tiny_llama_dir))
    theirs = _theirs(tmp_path / "out", target)
    assert theirs.config.norm_output == bool(variant.get("norm_output"))
    assert torch.equal(theirs.d2t + torch.arange(vocab.numel()), vocab)
    mine = _compare(head, theirs, target)
    if variant:  # the variant changes what the head computes (so the comparison can tell)
        plain = _ours(target, {}, vocab)
        with torch.no_grad():
            plain.load_state_dict(head.state_dict(), strict=False)
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, target.config.vocab_size, (1, 10 + STEPS), generator=g)
        feats = torch.randn(1, 10, head.feature_size, generator=g) * 2
        with torch.no_grad():
            other = [plain.logits(p[0]) for p in plain.forward_unrolled(ids, feats, STEPS)]
        assert not all(torch.allclose(a, b, atol=1e-3) for a, b in zip(mine, other, strict=True))


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "+".join(v) or "plain")
def test_a_speculators_checkpoint_computes_the_same_here(target, tiny_llama_dir, tmp_path, variant):
    vocab = torch.tensor([1, 2, 4, 8, 16, 32, 64])
    # written by speculators: our export gives it the config layout, speculators rewrites it
    seed = _ours(target, {}, vocab)
    save_head(seed, tmp_path / "seed", target.config, {})
    export_head(
        tmp_path / "seed", target, "speculators", tmp_path / "seed-out", str(tiny_llama_dir)
    )
    cfg = Eagle3SpeculatorConfig.from_pretrained(tmp_path / "seed-out")
    for k, v in variant.items():
        setattr(cfg, k, v)
    cfg.transformer_layer_config._attn_implementation = "eager"
    model = Eagle3DraftModel(cfg)
    _randomise(model, 2)
    with torch.no_grad():
        model.embed_tokens.weight.copy_(target.embed_tokens.weight)
        model.d2t.copy_(vocab - torch.arange(vocab.numel()))
        model.t2d.zero_()
        model.t2d[vocab] = True
    model.save_pretrained(tmp_path / "theirs")
    loaded = load_head(tmp_path / "theirs", target).eval()
    for k in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"):
        assert loaded.variant[k] == bool(getattr(cfg, k)), k
    assert torch.equal(loaded.vocab_ids, vocab)
    _compare(loaded, model.float().eval(), target)


def test_the_shipped_smollm2_head_computes_the_same_in_speculators(smol, tmp_path):
    """The EAGLE-3 head shipped for SmolLM2-135M-Instruct, exported with the converted model's
    directory as the verifier, in speculators' model code (fp32 both)."""
    from specdecode.models.head_io import ASSETS

    loaded, _ = smol
    path = ASSETS / "smollm2-135m-eagle3"
    ours = load_head(path, loaded.model).float().eval()
    export_head(path, loaded.model, "speculators", tmp_path / "out", str(loaded.path))
    theirs = _theirs(tmp_path / "out", loaded.model)
    assert theirs.config.eagle_aux_hidden_state_layer_ids == list(ours.aux_layers)
    _compare(ours, theirs, loaded.model)
