"""Self-distillation data (shards, resume, torchrun split) and draft distillation, tiny model."""

from __future__ import annotations

import pytest
import torch

from specdecode import LLM, SamplingParams
from specdecode.errors import DataError
from specdecode.train.datagen import (
    answered_ids,
    generate,
    iter_examples,
    read_shard,
    shard_path,
)
from specdecode.train.draft import DraftTrainConfig, layer_indices, train_draft

CONVS = [(f"c{i}", [{"role": "user", "content": f"question {i}: abc{i}"}]) for i in range(6)]


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(str(tiny_llama_dir))


def test_shards_hold_prompt_and_answer_with_mask(llm, tmp_path):
    generate(llm, CONVS, tmp_path, shard_size=2, max_tokens=12)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "shard-00000.safetensors",
        "shard-00001.safetensors",
        "shard-00002.safetensors",
    ]
    examples = list(iter_examples(tmp_path))
    assert [e.conversation_id for e in examples] == [c for c, _ in CONVS]
    for ex, (_, messages) in zip(examples, CONVS, strict=True):
        prompt = llm._chat_ids(messages)
        assert ex.input_ids[: len(prompt)] == prompt
        assert ex.loss_mask == [0] * len(prompt) + [1] * (len(ex.input_ids) - len(prompt))
        answer = llm.generate(
            {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=12)
        )
        assert ex.input_ids[len(prompt) :] == answer[0].outputs[0].token_ids


def test_resume_after_interruption(llm, tmp_path):
    generate(llm, CONVS, tmp_path, shard_size=2, max_tokens=8)
    kept = shard_path(tmp_path, 0).stat().st_mtime_ns
    lost = read_shard(shard_path(tmp_path, 1))
    shard_path(tmp_path, 1).unlink()  # as if the run had stopped before writing it
    written = generate(llm, CONVS, tmp_path, shard_size=2, max_tokens=8)
    assert written == [shard_path(tmp_path, 1)]
    assert shard_path(tmp_path, 0).stat().st_mtime_ns == kept
    assert read_shard(shard_path(tmp_path, 1)) == lost


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_a_damaged_shard_is_a_clear_error_and_regenerated_on_resume(llm, tmp_path, damage):
    generate(llm, CONVS, tmp_path, shard_size=2, max_tokens=8)
    path = shard_path(tmp_path, 1)
    good = read_shard(path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"not a shard" * 9)
    with pytest.raises(DataError, match="shard-00001.*not a readable data shard"):
        list(iter_examples(tmp_path))
    with pytest.raises(DataError, match="shard-00001"):
        answered_ids(tmp_path)
    assert generate(llm, CONVS, tmp_path, shard_size=2, max_tokens=8) == [path]
    assert read_shard(path) == good


def test_a_longer_run_over_the_same_directory_fills_the_partial_last_shard(llm, tmp_path):
    """Extending a run (5 -> 6 conversations, shards of 2) regenerates the last shard the first
    run left partly filled; a different shard size over the same directory is refused; a chat
    that opens with a system turn is asked its first user turn."""
    from specdecode.errors import InvalidRequestError

    generate(llm, CONVS[:5], tmp_path, shard_size=2, max_tokens=4)
    assert [e.conversation_id for e in iter_examples(tmp_path)] == ["c0", "c1", "c2", "c3", "c4"]
    written = generate(llm, CONVS, tmp_path, shard_size=2, max_tokens=4)
    assert written == [shard_path(tmp_path, 2)]
    assert [e.conversation_id for e in iter_examples(tmp_path)] == [c for c, _ in CONVS]
    with pytest.raises(InvalidRequestError, match=r"shard_size 2 \(this run: 3\)"):
        generate(llm, CONVS, tmp_path, shard_size=3, max_tokens=4)
    # shard sizes whose ranges start alike (2 -> 4, 4 -> 2) would have duplicated answers
    for first, then in ((2, 4), (4, 2)):
        out = tmp_path / f"sizes-{first}-{then}"
        generate(llm, CONVS[:4], out, shard_size=first, max_tokens=4)
        with pytest.raises(InvalidRequestError, match=rf"shard_size {first} \(this run: {then}"):
            generate(llm, CONVS[:4], out, shard_size=then, max_tokens=4)
        assert [e.conversation_id for e in iter_examples(out)] == ["c0", "c1", "c2", "c3"]
    with pytest.raises(InvalidRequestError, match="--features"):  # shards without features
        generate(llm, CONVS, tmp_path, shard_size=2, max_tokens=4, feature_layers=(0, 1))
    # another length or temperature would mix two runs' answers in one data set
    with pytest.raises(InvalidRequestError, match=r"max_tokens 4 \(this run: 8\)"):
        generate(llm, CONVS, tmp_path, shard_size=2, max_tokens=8)
    with pytest.raises(InvalidRequestError, match=r"temperature 0.0 \(this run: 0.8\)"):
        generate(llm, CONVS, tmp_path, shard_size=2, max_tokens=4, temperature=0.8)
    system = [("s0", [{"role": "system", "content": "a banner"}, *CONVS[0][1]])]
    (ex,) = read_shard(generate(llm, system, tmp_path / "sys", max_tokens=4)[0])
    prompt = llm._chat_ids(CONVS[0][1])
    assert ex.input_ids[: len(prompt)] == prompt


def test_a_second_data_set_skips_the_conversations_of_the_first(llm, tmp_path, capsys):
    from specdecode.cli import main

    first = tmp_path / "first"
    generate(llm, CONVS[:3], first, shard_size=2, max_tokens=4)
    assert answered_ids(first) == {"c0", "c1", "c2"}
    with pytest.raises(DataError, match="does not exist"):
        answered_ids(tmp_path / "missing")
    missing = ["data", "generate", "--out", str(tmp_path / "x"), "--exclude-data", "nowhere"]
    assert main(missing) == 2  # a clear error, before any model loads
    # the CLI path: --exclude-data reads the ids, and the remaining conversations are answered
    code = [(cid, m) for cid, m in CONVS]
    import specdecode.data as data

    orig = data.SOURCES["sharegpt-code"]
    data.SOURCES["sharegpt-code"] = lambda split: iter(code)
    try:
        second = tmp_path / "second"
        args = ["data", "generate", "--model", str(llm.engine.model_path), "--out", str(second),
                "--source", "sharegpt-code", "--exclude-data", str(first), "--max-tokens", "4",
                "--num-conversations", "2", "--features", "none"]  # fmt: skip
        rc = main(args)
        assert capsys.readouterr().out.strip().endswith(f"wrote 1 of 1 shards to {second}")
        main(args)  # again: nothing left to do, and it says so
        assert capsys.readouterr().out.strip().endswith("wrote 0 of 1 shards to " + str(second)
                                                       + "; 1 already there")  # fmt: skip
    finally:
        data.SOURCES["sharegpt-code"] = orig
    assert rc in (0, None)
    assert [e.conversation_id for e in iter_examples(second)] == ["c3", "c4"]


def test_torchrun_ranks_split_the_shards(llm, tmp_path, monkeypatch):
    """Each rank writes its shards; every rank checks the other ranks' shards too, so a
    directory never holds two runs' answers, and training refuses one that does."""
    from specdecode.errors import InvalidRequestError
    from specdecode.train.datagen import shard_metadata

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    written = generate(llm, CONVS, tmp_path, shard_size=2, max_tokens=4)
    assert written == [shard_path(tmp_path, 1)]
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(InvalidRequestError, match=r"max_tokens 4 \(this run: 8\)"):
        generate(llm, CONVS, tmp_path, shard_size=2, max_tokens=8)
    assert not shard_path(tmp_path, 0).exists()
    # a mixed directory (written before this check, or put together by hand) is refused
    generate(llm, CONVS[:2], tmp_path / "other", shard_size=2, max_tokens=8)
    shard_path(tmp_path / "other", 0).rename(shard_path(tmp_path, 0))
    with pytest.raises(DataError, match="max_tokens 4 .vs 8."):
        shard_metadata(tmp_path)
    cfg = DraftTrainConfig(num_layers=1, steps=1, batch_size=2, eval_examples=1)
    with pytest.raises(DataError, match="other settings"):
        train_draft(llm.engine.model, tmp_path, tmp_path / "draft", cfg, [2])


def test_layer_indices():
    assert layer_indices(30, 2) == [0, 29]
    assert layer_indices(30, 4) == [0, 10, 19, 29]
    assert layer_indices(2, 5) == [0, 1]


def test_train_draft_learns_and_serves_losslessly(llm, tiny_llama_dir, tmp_path):
    convs = [
        (f"c{i}", [{"role": "user", "content": f"say {i % 7} {i % 5} {i}"}]) for i in range(48)
    ]
    generate(llm, convs, tmp_path / "data", shard_size=16, max_tokens=24)
    from specdecode.models.loader import load_model

    target = load_model(tiny_llama_dir).model  # trainable copy (the engine's is packed)
    cfg = DraftTrainConfig(
        num_layers=1, draft_vocab=64, steps=40, batch_size=8, lr=3e-3, eval_examples=8
    )
    history = train_draft(target, tmp_path / "data", tmp_path / "draft", cfg, [2], tiny_llama_dir)
    assert history["after"]["loss"] < history["before"]["loss"]
    spec = LLM(
        str(tiny_llama_dir),
        speculative_config={
            "method": "draft_model",
            "model": str(tmp_path / "draft"),
            "num_speculative_tokens": 3,
        },
        speculative_policy="static",
    )
    prompts = ["say 3 1 9", "abcabc", "xyz"]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, params)] == want
    assert spec.engine.spec_stats.num_draft_tokens > 0


def test_shards_store_the_targets_features(llm, tiny_llama_dir, tmp_path):
    """Features recorded during generation equal a fresh dense forward of the target (the
    entry of layer 1 and the final feature), one row per token but the last."""
    from specdecode.models.loader import load_model

    generate(llm, CONVS[:3], tmp_path, shard_size=2, max_tokens=10, feature_layers=(1,))
    assert llm.engine.runner.feature_layers is None  # switched off again
    target = load_model(tiny_llama_dir).model
    examples = list(iter_examples(tmp_path))
    assert len(examples) == 3
    for ex in examples:
        import torch

        out = target.forward_dense(torch.tensor([ex.input_ids]), capture_layers=(1,))
        want = torch.cat([out.captured[0], out.hidden], -1)[0, :-1]
        assert ex.features.shape == (len(ex.input_ids) - 1, 2 * 64)
        torch.testing.assert_close(ex.features.float(), want, atol=2e-2, rtol=2e-2)


def test_draft_training_skips_batches_with_no_answer_within_max_len(llm, tiny_llama_dir, tmp_path):
    """Prompts longer than --max-len leave a batch nothing to learn: skipped, and the held-out
    figures are weighted by answer tokens (one empty batch made them NaN)."""
    import math

    from specdecode.models.loader import load_model

    convs = [
        (f"c{i}", [{"role": "user", "content": ("x" * 60 if i % 2 else "") + f"say {i}"}])
        for i in range(24)
    ]
    generate(llm, convs, tmp_path / "data", shard_size=16, max_tokens=12)
    target = load_model(tiny_llama_dir).model
    cfg = DraftTrainConfig(num_layers=1, draft_vocab=64, steps=6, batch_size=1, max_len=40,
                           eval_examples=6)  # fmt: skip
    history = train_draft(target, tmp_path / "data", tmp_path / "draft", cfg, [2])
    for when in ("before", "after"):
        assert all(math.isfinite(v) for v in history[when].values()), history[when]


def test_train_draft_stops_continues_and_refuses_what_cannot_pay(llm, tiny_llama_dir, tmp_path):
    """A review of `train draft`: the draft vocabulary is topped up to --draft-vocab (0: the
    full one) where the data has fewer tokens; a time budget stops and saves, --init continues
    a saved draft (its layers and vocabulary); a diverged run saves nothing; a draft as deep
    as its target, a broken draft folder and a draft given as a head are refused clearly."""
    from specdecode.errors import InvalidRequestError
    from specdecode.models.loader import load_model
    from specdecode.train.draft import load_trained_draft

    convs = [(f"c{i}", [{"role": "user", "content": f"say {i % 7} {i}"}]) for i in range(20)]
    generate(llm, convs, tmp_path / "data", shard_size=16, max_tokens=12)
    target = load_model(tiny_llama_dir).model
    vocab = target.config.vocab_size

    def train(out, **kw):
        cfg = DraftTrainConfig(**{"num_layers": 1, "draft_vocab": 64, "steps": 4,
                                  "batch_size": 4, "eval_examples": 4, **kw})  # fmt: skip
        return train_draft(target, tmp_path / "data", tmp_path / out, cfg, [2])

    first = train("a", draft_vocab=vocab - 1)  # more than the data's tokens: topped up
    assert first["draft_vocab_size"] == vocab - 1 and first["steps_done"] == 4
    assert train("b", draft_vocab=0)["draft_vocab_size"] == vocab
    h = train("c", steps=10_000, max_minutes=1e-9)
    assert h["stopped_by"].startswith("time budget") and h["steps_done"] == 0
    assert (tmp_path / "c" / "model.safetensors").is_file()  # saved as it stands
    # --init: goes on from the saved draft (stored in bf16: its loss to 1e-2), its own kept
    h = train("a", init=str(tmp_path / "a"), num_layers=5, draft_vocab=1)
    assert h["draft_vocab_size"] == vocab - 1 and h["source_layers"] == first["source_layers"]
    assert (h["config"]["num_layers"], h["config"]["draft_vocab"]) == (1, vocab - 1)
    assert h["before"]["loss"] == pytest.approx(first["after"]["loss"], abs=1e-2)
    with pytest.raises(DataError, match="diverged"):
        train("d", lr=1e12, steps=20)
    assert not (tmp_path / "d").exists()
    with pytest.raises(InvalidRequestError, match="the target has 2 layers"):
        train("e", num_layers=2)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((tmp_path / "a" / "config.json").read_text())
    with pytest.raises(InvalidRequestError, match="not a readable trained draft"):
        load_trained_draft(broken, target)
    with pytest.raises(InvalidRequestError, match="a draft model from .* method draft_model"):
        LLM(str(tiny_llama_dir), speculative_config={"method": "eagle",
                                                      "model": str(tmp_path / "a")})  # fmt: skip


def test_draft_of_a_half_precision_target_trains_fp32_master_weights(tiny_llama_dir):
    """A bf16 target's draft keeps fp32 weights (AdamW's small updates vanish on bf16 ones)
    and runs its matmuls under bf16 autocast; only the shared embeddings stay the target's."""
    import math

    import torch

    from specdecode.models.loader import load_model
    from specdecode.train.draft import _losses, make_draft

    target = load_model(tiny_llama_dir, dtype=torch.bfloat16).model
    draft = make_draft(target, 1, torch.arange(64))
    trained = {n: p.dtype for n, p in draft.named_parameters() if p.requires_grad}
    assert trained and set(trained.values()) == {torch.float32}, trained
    assert draft.embed_tokens.weight is target.embed_tokens.weight
    ids = torch.randint(3, 64, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.bool)
    feats = target.forward_dense(ids).hidden[mask]
    loss, _, n = _losses(target, draft, ids, mask, feats)
    loss.backward()
    assert n == 24 and math.isfinite(loss.item())
    assert draft.lm_head.weight.grad.dtype == torch.float32


def test_train_draft_takes_several_data_sets_from_the_command_line(
    llm, tiny_llama_dir, tmp_path, capsys
):
    """`train draft --data A --data B` trains on both, holding out --eval-examples of each (a
    review found the first --data dropped and the held-out size fixed at 32)."""
    import json

    from specdecode.cli import main

    generate(llm, CONVS[:3], tmp_path / "a", shard_size=2, max_tokens=6)
    generate(llm, CONVS[3:], tmp_path / "b", shard_size=2, max_tokens=6)
    argv = ["train", "draft", "--model", str(tiny_llama_dir), "--data", str(tmp_path / "a"),
            "--data", str(tmp_path / "b"), "--out", str(tmp_path / "d"), "--num-layers", "1",
            "--draft-vocab", "64", "--steps", "2", "--batch-size", "2",
            "--eval-examples", "1"]  # fmt: skip
    assert main(argv) == 0
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    history = config["specdecode_draft"]["training"]
    assert history["train_examples"] == 4 and history["held_out_examples"] == 2
    # two sets of the same conversations: each trained on once, none of the held-out ones
    overlap = [*argv[:7], str(tmp_path / "a"), "--out", str(tmp_path / "d2"), *argv[10:]]
    assert main(overlap) == 0
    config = json.loads((tmp_path / "d2" / "config.json").read_text())
    training = config["specdecode_draft"]["training"]
    assert training["train_examples"] == 2  # c0, c1 (c2 held)
    assert training["held_out_examples"] == 1  # c2 held out by both sets, counted once
    # it runs beside its target: on its own, or as a head to export, it is a clear error
    for argv, message in (
        (["generate", "--model", str(tmp_path / "d"), "--prompt", "hi"], "runs beside that target"),
        (["export", str(tmp_path / "d"), "--model", str(tiny_llama_dir), "--format", "vllm",
          "--out", str(tmp_path / "x")], "not a head"),
    ):  # fmt: skip
        capsys.readouterr()
        assert main(argv) == 2
        assert message in capsys.readouterr().err


@pytest.mark.parametrize("how", ["ctrl-c", "interrupt", "killed"])
def test_a_stopped_draft_run_resumes_bit_for_bit(llm, tiny_llama_dir, tmp_path, monkeypatch, how):
    """`train draft --resume` continues where the run stopped (Ctrl-C: after the step in
    flight; an interrupt inside a step, as a second Ctrl-C: that step runs again; killed: from
    its last checkpoint) with its fp32 weights, optimizer moments, schedule and data order: the
    weights at the end equal an uninterrupted run's bit for bit."""
    import os
    import signal

    from safetensors.torch import load_file

    import specdecode.train.draft as draft_mod
    from specdecode.models.loader import load_model
    from specdecode.train.draft import STATE_FILE, resume_draft_config

    convs = [(f"c{i}", [{"role": "user", "content": f"say {i % 7} {i}"}]) for i in range(24)]
    generate(llm, convs, tmp_path / "data", shard_size=12, max_tokens=12)
    target = load_model(tiny_llama_dir).model
    cfg = DraftTrainConfig(num_layers=1, draft_vocab=48, steps=7, batch_size=4, lr=3e-3,
                           eval_examples=4, checkpoint_minutes=0.0)  # fmt: skip

    def weights(out):
        t = load_file(str(out / STATE_FILE))
        return {k: v for k, v in t.items() if k.startswith(("weights.", "optimizer."))}

    whole = train_draft(target, tmp_path / "data", tmp_path / "whole", cfg, [2])
    real, calls = draft_mod._losses, []

    def stopping(*a, **k):
        calls.append(torch.is_grad_enabled())  # (evaluation runs without gradients)
        if calls[-1] and sum(calls) == 4:  # during the fourth step
            if how == "ctrl-c":
                os.kill(os.getpid(), signal.SIGINT)  # (the step goes on; training stops after)
            else:
                raise KeyboardInterrupt if how == "interrupt" else RuntimeError("killed")
        return real(*a, **k)

    monkeypatch.setattr(draft_mod, "_losses", stopping)
    out = tmp_path / "stopped"
    # (Python's own Ctrl-C handler, as in a terminal; a background job ignores SIGINT)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        if how != "killed":
            stopped = train_draft(target, tmp_path / "data", out, cfg, [2])["stopped_by"]
            assert stopped == "interrupt"
            assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # (restored)
        else:
            with pytest.raises(RuntimeError, match="killed"):
                train_draft(target, tmp_path / "data", out, cfg, [2])
    finally:
        signal.signal(signal.SIGINT, previous)
    monkeypatch.setattr(draft_mod, "_losses", real)
    resumed_cfg = resume_draft_config(out)
    assert (resumed_cfg.steps, resumed_cfg.num_layers, resumed_cfg.resume) == (7, 1, True)
    history = train_draft(target, tmp_path / "data", out, resumed_cfg, [2])
    assert history["resumed_at_step"] == (4 if how == "ctrl-c" else 3)
    assert history["steps_done"] == whole["steps_done"]
    a, b = weights(tmp_path / "whole"), weights(out)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert history["after"] == whole["after"]
    # other data is refused, and a folder with no run says so
    with pytest.raises(DataError, match="below the run's"):  # (--steps only goes up)
        train_draft(target, tmp_path / "data", out, resume_draft_config(out, steps=3), [2])
    generate(llm, convs[:20], tmp_path / "fewer", shard_size=12, max_tokens=12)
    with pytest.raises(DataError, match="other --data"):
        train_draft(target, tmp_path / "fewer", out, resumed_cfg, [2])
    with pytest.raises(DataError, match="no run to resume"):
        resume_draft_config(tmp_path / "data")
