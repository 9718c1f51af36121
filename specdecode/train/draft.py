"""`specdecode train draft`: distil a small draft model from the target (Gen 1 for targets that
have no smaller sibling, such as SmolLM2-135M).

The draft is a shallow copy of the target: `num_layers` of its layers (evenly spaced, first and
last included), its final norm, and its embeddings, shared with the target at run time (frozen,
never stored twice). Its LM head covers only the `draft_vocab` most frequent answer tokens of the
training data (rows of the target's head), which cuts the cost that dominates small models; the
draft never proposes other tokens, which keeps verification lossless. Training minimises the
cross-entropy to the target's own next-token distribution (restricted to the draft vocabulary)
on the target's own answers (`specdecode data generate`).

Saved layout (a directory): config.json (Hugging Face Llama config with `num_hidden_layers` =
the draft's, plus a `specdecode_draft` section) and model.safetensors (layers, norm, the reduced
head and its `vocab_ids`; no embeddings).
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from specdecode.errors import DataError
from specdecode.models.llama import LlamaModel
from specdecode.train.datagen import Example, hold_out, iter_examples, shard_metadata
from specdecode.train.state import (
    STATE_FILE,
    read_state,
    restore,
    resume_settings,
    train_digest,
    write_state,
)

log = logging.getLogger(__name__)


@dataclass
class DraftTrainConfig:
    num_layers: int = 2
    draft_vocab: int = 8192
    steps: int = 300
    batch_size: int = 8
    max_len: int = 384
    lr: float = 3e-4
    eval_examples: int = 32
    seed: int = 0
    max_minutes: float | None = None  # stop sooner (the draft as it stands is saved)
    init: str | None = None  # continue from a draft saved there (its layers and vocabulary)
    # write the draft as it stands, and what `resume` needs, to the output directory this often
    # (a run killed later keeps it); None: only at the end
    checkpoint_minutes: float | None = 5.0
    # continue the run saved in the output directory where it stopped (`resume_draft_config`):
    # its fp32 weights, optimizer moments, schedule, data order, step and time so far
    resume: bool = False


def resume_draft_config(out_dir: Path, **overrides) -> DraftTrainConfig:
    """The settings of the draft run saved in `out_dir`, to continue it with `resume`;
    `overrides` that are not None replace them (steps, the time budget, the checkpoints)."""
    older = "drafts saved before this version continue with --init"
    return resume_settings(out_dir, "draft", DraftTrainConfig, older, **overrides)


def layer_indices(total: int, n: int) -> list[int]:
    """n layer indices spread evenly over `total`, first and last included."""
    if n >= total:
        return list(range(total))
    if n == 1:
        return [total - 1]
    return sorted({round(i * (total - 1) / (n - 1)) for i in range(n)})


def frequent_tokens(
    examples: list[Example], k: int, always: list[int], vocab_size: int | None = None
) -> torch.Tensor:
    """The k most frequent answer tokens, always including `always` (EOS...). Tokens never seen
    in an answer are ranked next by their frequency in the prompts (answers often copy from the
    prompt), then, if `vocab_size` is given, unseen tokens by id (BPE vocabularies put the
    earliest, most common merges first)."""
    answer: dict[int, int] = {}
    prompt: dict[int, int] = {}
    for ex in examples:
        for t, m in zip(ex.input_ids, ex.loss_mask, strict=True):
            counts = answer if m else prompt
            counts[t] = counts.get(t, 0) + 1
    seen = set(answer) | set(prompt)
    ranked = sorted(seen, key=lambda t: (-answer.get(t, 0), -prompt.get(t, 0), t))
    if vocab_size is not None and len(ranked) < k:
        ranked += [t for t in range(vocab_size) if t not in seen][: k - len(ranked)]
    chosen = list(dict.fromkeys([*always, *ranked]))[:k]
    return torch.tensor(sorted(chosen), dtype=torch.long)


def make_draft(target: LlamaModel, num_layers: int, vocab_ids: torch.Tensor) -> LlamaModel:
    """A draft that starts as the chosen layers of the target, its weights in fp32 whatever
    the target's (master weights: a half-precision target's draft trains under autocast, see
    `_autocast`; AdamW's small updates are lost on bf16 weights)."""
    picked = layer_indices(target.config.num_layers, num_layers)
    cfg = replace(target.config, num_layers=len(picked))
    draft = LlamaModel(cfg).to(target.norm.weight.device, torch.float32)
    with torch.no_grad():
        draft.embed_tokens.weight = target.embed_tokens.weight  # shared, frozen
        for i, j in enumerate(picked):
            draft.layers[i].load_state_dict(target.layers[j].state_dict())
        draft.norm.load_state_dict(target.norm.state_dict())
        draft.lm_head.weight = target.lm_head.weight
    draft.reduce_vocab(vocab_ids)
    draft.lm_head.float()  # (its rows copied in the target's dtype)
    draft.embed_tokens.weight.requires_grad_(False)
    draft.source_layers = picked  # type: ignore[attr-defined]
    return draft


def _collate(batch: list[Example], max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [B, T] right-padded with 0; mask [B, T]: position t predicts token t+1, trained
    where token t+1 is an answer token."""
    t = min(max_len, max(len(ex.input_ids) for ex in batch))
    ids = torch.zeros(len(batch), t, dtype=torch.long)
    mask = torch.zeros(len(batch), t, dtype=torch.bool)
    for i, ex in enumerate(batch):
        n = min(t, len(ex.input_ids))
        ids[i, :n] = torch.tensor(ex.input_ids[:n])
        mask[i, : n - 1] = torch.tensor(ex.loss_mask[1:n], dtype=torch.bool)
    return ids, mask


@torch.no_grad()
def teacher_features(
    target: LlamaModel, examples: list[Example], max_len: int, batch_size: int = 8
) -> list[torch.Tensor]:
    """The target's final feature at every trained position of each example, computed once
    (the target is frozen) so that training epochs only run the small draft."""
    from tqdm import tqdm

    order = sorted(range(len(examples)), key=lambda i: len(examples[i].input_ids))
    out: list[torch.Tensor] = [torch.empty(0)] * len(examples)
    for i in tqdm(range(0, len(order), batch_size), desc="target features", unit="batch"):
        idx = order[i : i + batch_size]
        ids, mask = _collate([examples[j] for j in idx], max_len)
        device = target.norm.weight.device
        hidden = target.forward_dense(ids.to(device)).hidden
        mask = mask.to(device)
        for row, j in enumerate(idx):  # kept on the CPU: moved per training batch
            out[j] = hidden[row][mask[row]].cpu()
    return out


def _autocast(target: LlamaModel):
    """The draft's matmuls in a half-precision target's dtype (its weights stay fp32); off for
    an fp32 target."""
    dtype = target.norm.weight.dtype
    device = target.norm.weight.device.type
    return torch.autocast(device, dtype=dtype, enabled=dtype != torch.float32)


def _losses(
    target: LlamaModel,
    draft: LlamaModel,
    ids: torch.Tensor,
    mask: torch.Tensor,
    t_hidden: torch.Tensor,
):
    """Soft cross-entropy to the target (its features `t_hidden` [n, H] at the masked
    positions) restricted to the draft vocabulary, top-1 agreement with the target's
    full-vocabulary argmax, and n (0: no answer token within max_len, nothing to learn)."""
    n = int(mask.sum())
    if n == 0:
        return None, None, 0
    device = target.norm.weight.device
    ids, mask, t_hidden = ids.to(device), mask.to(device), t_hidden.to(device)
    with torch.no_grad():
        t_logits = target.compute_logits(t_hidden)
        t_top1 = t_logits.argmax(-1)
        p = t_logits[:, draft.vocab_ids].softmax(-1)
    with _autocast(target):
        d_hidden = draft.forward_dense(ids).hidden[mask]
        d_logits = draft.lm_head(d_hidden).float()
    loss = -(p * d_logits.log_softmax(-1)).sum(-1).mean()
    agree = (draft.vocab_ids[d_logits.argmax(-1)] == t_top1).float().mean()
    return loss, agree, n


def _batch(examples, features, idx, max_len):
    ids, mask = _collate([examples[j] for j in idx], max_len)
    return ids, mask, torch.cat([features[j] for j in idx])


def train_draft(
    target: LlamaModel,
    data_dir: Path | list[Path],
    out_dir: Path,
    cfg: DraftTrainConfig,
    eos_ids: list[int],
    tokenizer_dir: Path | None = None,
) -> dict:
    from tqdm import tqdm

    torch.manual_seed(cfg.seed)
    # one or more data sets, the last eval_examples of each held out (as the heads' training)
    sets = []
    for d in [data_dir] if isinstance(data_dir, (str, Path)) else data_dir:
        shard_metadata(Path(d))  # (one run's answers: an error for a mixed directory)
        examples = list(iter_examples(Path(d), features=False))  # (a head's features: unused)
        if len(examples) <= cfg.eval_examples:
            raise DataError(
                f"{d} holds {len(examples)} examples; need more than {cfg.eval_examples} (the "
                "last ones are held out for evaluation: --eval-examples)"
            )
        sets.append((str(d), examples))
    train, _, held = hold_out(sets, cfg.eval_examples)
    target.requires_grad_(False).eval()
    digest = train_digest(train)
    if cfg.resume:  # the run in out_dir: its draft's shape (the weights come from its state)
        _check_resumable(out_dir, cfg, digest)  # (before the teacher's features: minutes)
        draft = load_trained_draft(out_dir, target, trainable=True)
        vocab_ids = draft.vocab_ids
    elif cfg.init is not None:  # its own layers and vocabulary, trained on (and recorded)
        draft = load_trained_draft(Path(cfg.init), target, trainable=True)
        vocab_ids = draft.vocab_ids
        cfg = replace(cfg, num_layers=draft.config.num_layers, draft_vocab=len(vocab_ids))
    else:
        check_draft_depth(cfg.num_layers, target.config.num_layers)
        # (0, or at least the vocabulary's size: the full vocabulary; else the most frequent
        # answer tokens, topped up with unseen ones where the data has fewer)
        size = target.config.vocab_size
        k = size if cfg.draft_vocab == 0 else min(cfg.draft_vocab, size)
        vocab_ids = frequent_tokens(train, k, eos_ids, size)
        draft = make_draft(target, cfg.num_layers, vocab_ids)
    coverage = answer_coverage(held, vocab_ids)
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)

    def rate(s: int) -> float:  # warm-up, then a cosine over the run's --steps
        return min(1.0, (s + 1) / 20) * 0.5 * (1 + math.cos(math.pi * s / cfg.steps))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, rate)
    train_feats = teacher_features(target, train, cfg.max_len, cfg.batch_size)
    held_feats = teacher_features(target, held, cfg.max_len, cfg.batch_size)
    gen = torch.Generator().manual_seed(cfg.seed)
    order: list[int] = []
    done, start, spent = 0, 0, 0.0
    if cfg.resume:
        state, tensors = read_state(out_dir)
        restore(params, opt, tensors, state)
        sched.load_state_dict(state["scheduler"])
        gen.set_state(tensors["rng.data"])
        order = tensors["data.order"].tolist()
        done, start, spent = state["steps_done"], state["next_step"], state["train_seconds"]
        # the rate at the step reached on this run's schedule (raised --steps: a longer
        # cosine from here; the same --steps: the saved rate, bit for bit)
        for group, base in zip(opt.param_groups, sched.base_lrs, strict=True):
            group["lr"] = base * rate(sched.last_epoch)
        sched._last_lr = [group["lr"] for group in opt.param_groups]
        history = {"before": state["before"], "resumed_at_step": start}
        log.info("resuming the draft at step %d of %d", start, cfg.steps)
    else:
        history = {"before": _evaluate(target, draft, held, held_feats, cfg)}
    t0 = time.perf_counter() - spent  # (a resumed run's time counts on)
    deadline = None if cfg.max_minutes is None else t0 + 60 * cfg.max_minutes
    stopped_by = "steps"
    last_save = time.perf_counter()

    def checkpoint(next_step: int, final: bool = False) -> None:
        info = {"checkpoint": not final, "steps_done": done, "config": cfg.__dict__,
                "train_seconds": round(time.perf_counter() - t0, 1)}  # fmt: skip
        if not final:  # (the end's draft is saved with its whole history below)
            save_draft(draft, out_dir, target, info, tokenizer_dir)
        state = {"steps_done": done, "next_step": next_step, "before": history["before"],
                 "train_seconds": info["train_seconds"], "config": cfg.__dict__,
                 "train_digest": digest}  # fmt: skip
        tensors = {"data.order": torch.tensor(order, dtype=torch.long), "rng.data": gen.get_state()}
        write_state(out_dir, params, opt, tensors,
                    {**state, "kind": "draft", "scheduler": sched.state_dict()})  # fmt: skip

    bar = tqdm(range(start, cfg.steps), desc="training draft", unit="step", initial=start,
               total=cfg.steps)  # fmt: skip
    position = start  # the next step to run (past skipped batches, unlike `done`)
    snapshot = None  # the data order and generator before the step in flight
    # Ctrl-C stops training at the next step boundary (a second one at once): the draft as it
    # stands is evaluated and saved, its state whole for --resume
    interrupted = threading.Event()
    restore_sigint = _on_sigint(interrupted)
    try:
        for step in bar:
            if interrupted.is_set():
                stopped_by = "interrupt"
                break
            if deadline is not None and time.perf_counter() >= deadline:
                stopped_by = f"time budget ({cfg.max_minutes:g} min)"
                break
            position = step
            snapshot = (list(order), gen.get_state())
            if len(order) < cfg.batch_size:
                order = torch.randperm(len(train), generator=gen).tolist()
            idx, order = order[: cfg.batch_size], order[cfg.batch_size :]
            loss, agree, n = _losses(target, draft, *_batch(train, train_feats, idx, cfg.max_len))
            if not n:  # no answer token within max_len in this batch
                position, snapshot = step + 1, None
                continue
            value = loss.item()
            if not math.isfinite(value):  # nothing worth saving comes of it
                raise DataError(
                    f"training diverged at step {step + 1} (loss {value}); nothing was saved: "
                    f"lower --lr (it is {cfg.lr:g})"
                )
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            done += 1
            position, snapshot = step + 1, None
            bar.set_postfix(loss=f"{value:.3f}", top1=f"{agree.item():.2f}")
            if cfg.checkpoint_minutes is not None and (
                time.perf_counter() - last_save >= 60 * cfg.checkpoint_minutes
            ):
                checkpoint(position)
                last_save = time.perf_counter()
    except KeyboardInterrupt:
        # (a second Ctrl-C, or one off the main thread): the step it cut short runs again on
        # resuming, its batch back in the data order
        stopped_by = "interrupt"
        if snapshot is not None:
            order, _ = snapshot[0], gen.set_state(snapshot[1])
    finally:
        restore_sigint()
        bar.close()
    history["after"] = _evaluate(target, draft, held, held_feats, cfg)
    if not all(math.isfinite(v) for v in history["after"].values()):
        raise DataError(
            f"training diverged (held-out {history['after']}); nothing was saved: lower --lr "
            f"(it is {cfg.lr:g})"
        )
    history.update(
        steps_done=done,
        stopped_by=stopped_by,
        draft_vocab_size=int(vocab_ids.numel()),
        train_seconds=time.perf_counter() - t0,
        train_examples=len(train),
        held_out_examples=len(held),
        draft_vocab_coverage=coverage,
        source_layers=draft.source_layers,
        config=cfg.__dict__,
    )
    save_draft(draft, out_dir, target, history, tokenizer_dir)
    checkpoint(position, final=True)  # (a finished run goes on with --resume, more --steps)
    return history


def _on_sigint(flag: threading.Event):
    """Make Ctrl-C set `flag` (a second one raises KeyboardInterrupt at once); return what
    restores the previous handler. Off the main thread, signals cannot be caught: nothing."""
    import signal

    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:  # (nohup, a background job: kept)
        return lambda: None

    def handler(signum, frame):
        if flag.is_set():
            raise KeyboardInterrupt
        flag.set()
        log.warning("Ctrl-C: stopping after this step and saving the draft (again: at once)")

    previous = signal.signal(signal.SIGINT, handler)
    return lambda: signal.signal(signal.SIGINT, previous)


def _check_resumable(out_dir: Path, cfg: DraftTrainConfig, digest: str) -> None:
    """The checks a resume can fail, from the state's header alone: the same data, a budget
    left, --steps not below the run's."""
    path = out_dir / STATE_FILE
    state, _ = read_state(out_dir, tensors=False)
    if state.get("train_digest") != digest:
        raise DataError(
            f"{path} was trained on other --data (other conversations, or in another order): "
            "resume with the same data (--init trains on other data)"
        )
    if cfg.steps < state["config"]["steps"]:
        raise DataError(
            f"--steps {cfg.steps} is below the run's {state['config']['steps']}: --resume "
            "goes on with the run's steps or more"
        )
    spent, reached = state["train_seconds"], state["next_step"]
    if cfg.max_minutes is not None and spent >= 60 * cfg.max_minutes and reached < cfg.steps:
        raise DataError(
            f"the run in {out_dir} has used its time budget of {cfg.max_minutes:g} minutes "
            f"({spent / 60:.1f} trained): give --max-minutes above that to go on"
        )


def answer_coverage(examples: list[Example], vocab_ids: torch.Tensor | None) -> float:
    """The share of the examples' answer tokens a draft vocabulary holds (None: the whole)."""
    if vocab_ids is None:
        return 1.0
    allowed = set(vocab_ids.tolist())
    toks = [t for ex in examples for t, m in zip(ex.input_ids, ex.loss_mask, strict=True) if m]
    return sum(t in allowed for t in toks) / max(1, len(toks))


@torch.no_grad()
def _evaluate(target, draft, held: list[Example], feats, cfg: DraftTrainConfig) -> dict:
    loss_sum = agree_sum = total = 0.0  # weighted by answer tokens
    for i in range(0, len(held), cfg.batch_size):
        idx = list(range(i, min(i + cfg.batch_size, len(held))))
        loss, agree, n = _losses(target, draft, *_batch(held, feats, idx, cfg.max_len))
        if n:
            loss_sum, agree_sum, total = (
                loss_sum + loss.item() * n,
                agree_sum + agree.item() * n,
                total + n,
            )
    if not total:
        raise DataError(f"no held-out answer token lies within --max-len {cfg.max_len}")
    return {"loss": loss_sum / total, "top1_agreement": agree_sum / total}


def save_draft(
    draft: LlamaModel, out_dir: Path, target: LlamaModel, history: dict, tokenizer_dir: Path | None
) -> None:
    from specdecode.models.loader import write_safetensors

    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {
        k: v.to(torch.bfloat16) for k, v in draft.hf_state_dict().items() if "embed_tokens" not in k
    }
    tensors["vocab_ids"] = draft.vocab_ids.cpu()
    write_safetensors(tensors, out_dir / "model.safetensors")
    c = target.config
    config = {
        "architectures": [c.hf_architecture],
        **c.hf_dict(num_layers=draft.config.num_layers),
        "specdecode_draft": {
            "embeddings": "shared with the target",
            "draft_vocab_size": int(draft.vocab_ids.numel()),
            "source_layers": draft.source_layers,
            "training": history,
        },
    }
    tmp = out_dir / "config.json.tmp"  # (rewritten at every checkpoint: never half written)
    tmp.write_text(json.dumps(config, indent=2))
    tmp.replace(out_dir / "config.json")
    if tokenizer_dir is not None:
        import shutil

        for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            if (tokenizer_dir / f).is_file():
                shutil.copy(tokenizer_dir / f, out_dir / f)


def is_trained_draft(path: Path) -> bool:
    cfg = path / "config.json"
    return cfg.is_file() and "specdecode_draft" in json.loads(cfg.read_text())


def check_draft_depth(num_layers: int, target_layers: int) -> None:
    """A draft as deep as its target costs as much as the target: it can never pay."""
    if num_layers >= target_layers:
        from specdecode.errors import InvalidRequestError

        raise InvalidRequestError(
            f"--num-layers {num_layers}: the target has {target_layers} layers, and a draft as "
            "deep costs what the target does; give fewer"
        )


def load_trained_draft(path: Path, target: LlamaModel, trainable: bool = False) -> LlamaModel:
    """A draft saved by `save_draft`, its embeddings taken from `target` (no copy);
    `trainable`: its own weights in fp32 and trainable (`train draft --init`), else frozen in
    the target's dtype."""
    from safetensors.torch import load_file

    from specdecode.config import ModelConfig
    from specdecode.errors import InvalidRequestError

    try:
        raw = json.loads((path / "config.json").read_text())
        cfg = ModelConfig.from_hf(raw)
        tensors = load_file(str(path / "model.safetensors"))
        vocab_ids = tensors.pop("vocab_ids").long()
    except Exception as e:  # noqa: BLE001 - a missing, truncated or foreign file
        raise InvalidRequestError(
            f"{path} is not a readable trained draft ({type(e).__name__}: {e})"
        ) from None
    if cfg.vocab_size != target.config.vocab_size or cfg.hidden_size != target.config.hidden_size:
        raise InvalidRequestError(f"{path} was trained for a different target model")
    dtype, device = target.norm.weight.dtype, target.norm.weight.device
    own = torch.float32 if trainable else dtype
    with torch.device("meta"):  # (in its dtype before it takes memory)
        draft = LlamaModel(cfg).to(own)
    draft = draft.to_empty(device=device)
    draft.embed_tokens.weight = target.embed_tokens.weight
    draft.reduce_vocab(vocab_ids)
    try:
        draft.load_hf_weights(tensors.items(), provided=("embed_tokens.weight",))
    except (KeyError, RuntimeError) as e:  # a tensor missing or of another shape
        raise InvalidRequestError(f"{path} is not a complete trained draft ({e})") from None
    if not trainable:
        return draft.eval().requires_grad_(False)
    draft.embed_tokens.weight.requires_grad_(False)
    draft.source_layers = raw.get("specdecode_draft", {}).get("source_layers")  # type: ignore[attr-defined]
    return draft
