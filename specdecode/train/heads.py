"""`specdecode train medusa | eagle | eagle3`: draft heads on a frozen target's own generations.

Input: shards from `specdecode data generate` with the target's features (its final feature at
every token, plus EAGLE-3's layer inputs); the target is needed only for its embeddings and LM
head (its layers never run here). Targets are soft: the target's next-token distribution,
restricted to the draft vocabulary and renormalised (self-distillation). Only positions whose
predicted token is one the target generated (an answer token) are trained.

- Medusa-1: head k at position t predicts token t+2+k from f_t; loss = sum_k 0.8^k x soft CE.
- EAGLE-1: entry t = fc([embed(x_{t+1}); f_t + noise]) -> f'_{t+1}; loss = smooth-L1(f', f)
  + 0.1 x soft CE (Li et al. 2024), noise ~ U(-0.1, 0.1).
- EAGLE-3: training-time test over the low/mid/high features (see `train_eagle3`).
Several data directories train one head (say ShareGPT chats and its code requests). Held-out
metrics (the last `eval_examples` conversations of each directory): loss, and top-1 agreement
with the target's full-vocabulary argmax per draft position (Medusa: per head; EAGLE: unrolled
k steps, each fed the previous step's prediction, as when drafting).
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from specdecode.errors import DataError
from specdecode.models.head_io import save_head, target_signature
from specdecode.models.heads import EAGLE3_VARIANTS, Eagle3Head, EagleHead, MedusaHeads
from specdecode.models.llama import LlamaModel
from specdecode.train.datagen import (
    Example,
    hold_out,
    iter_examples,
    shard_metadata,
)
from specdecode.train.draft import answer_coverage, frequent_tokens
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
class HeadTrainConfig:
    draft_vocab: int = 16384  # 0: the full vocabulary
    steps: int = 1000
    batch_tokens: int = 4096
    max_len: int = 768
    lr: float = 1e-3
    warmup: int = 50
    eval_examples: int = 64
    eval_positions: int = 4
    seed: int = 0
    # Medusa
    num_heads: int = 4
    # EAGLE
    noise: float = 0.1
    ce_weight: float = 0.1
    # EAGLE-3
    ttt_steps: int = 4
    # the first `ttt_ramp` of the run (a fraction, by steps or time) unrolls fewer steps: 1, 2,
    # ... ttt_steps - 1 in equal shares, then ttt_steps (one step costs about a quarter of four)
    ttt_ramp: float = 0.0
    # speculators' EAGLE-3 variants, comma-separated (`Eagle3Head.set_variant`); "" = none
    variant: str = ""
    # continue from this head (same kind and draft vocabulary) instead of a fresh start
    init: str | None = None
    allow_pickle: bool = False  # `init` may be a pickle checkpoint (*.bin: it can run code)
    # stop after this many minutes if `steps` are not done by then; the learning-rate schedule
    # follows whichever ends first (cosine over the larger of steps or time done)
    max_minutes: float | None = None
    # bf16 autocast for the matmuls (master weights fp32). None: only where bf16 matmuls are
    # native (CUDA, or a CPU with AVX512-BF16 / AMX: about 2x); without them oneDNN emulates
    # bf16 and a matmul runs ~4x slower than fp32 (measured on a Zen 3 CPU with AVX2).
    bf16: bool | None = None
    # write the head as it stands to the output directory this often (a run killed later
    # keeps it; `init` continues from it); None: only at the end
    checkpoint_minutes: float | None = 5.0
    # continue the run saved in the output directory where it stopped (`resume_config`): its
    # weights, optimizer moments, step, schedule, data order and training time so far
    resume: bool = False


def resume_config(out_dir: Path, kind: str, **overrides) -> HeadTrainConfig:
    """The settings of the run saved in `out_dir` (a checkpoint, a run stopped by Ctrl-C or its
    time budget, or a finished one), to continue it with `resume`; `overrides` that are not
    None replace them (the time budget, the checkpoint interval, the number of steps)."""
    older = "heads saved before this version, or other projects' heads, continue with --init"
    return resume_settings(out_dir, kind, HeadTrainConfig, older, **overrides)


@dataclass
class _Batch:
    feats: torch.Tensor  # [B, L, F] target features at positions 0..L-1
    nxt: torch.Tensor  # [B, L + extra] token at position t+1
    valid: torch.Tensor  # [B, L + extra] bool: position t+1 exists and is an answer token
    rows: torch.Tensor  # [B] feature rows per example

    def to(self, device: torch.device) -> _Batch:
        """On `device`, features in fp32 (collated in bf16 for an accelerator: half the bytes
        cross to it)."""
        feats = self.feats.to(device).float()
        return _Batch(feats, self.nxt.to(device), self.valid.to(device), self.rows.to(device))


def _collate(
    examples: list[Example], max_len: int, extra: int, dtype: torch.dtype = torch.float32
) -> _Batch:
    rows = [min(max_len, ex.features.shape[0]) for ex in examples]
    b, n = len(examples), max(rows)
    feats = torch.zeros(b, n, examples[0].features.shape[1], dtype=dtype)
    nxt = torch.zeros(b, n + extra, dtype=torch.long)
    valid = torch.zeros(b, n + extra, dtype=torch.bool)
    for i, (ex, r) in enumerate(zip(examples, rows, strict=True)):
        feats[i, :r] = ex.features[:r]
        nxt[i, :r] = torch.tensor(ex.input_ids[1 : r + 1])
        valid[i, :r] = torch.tensor(ex.loss_mask[1 : r + 1], dtype=torch.bool)
    return _Batch(feats, nxt, valid, torch.tensor(rows))


@dataclass
class _Targets:
    probs: torch.Tensor  # [N, Vd] at the needed positions
    best: torch.Tensor | None  # [N]
    row_of: torch.Tensor  # [B, L] -> row of probs, -1 where not needed

    def at(self, sel: torch.Tensor, shift: int):
        """The labels of position t + shift for every (b, t) selected by `sel` [B, L] (the
        caller selects only positions t + shift whose label was needed)."""
        b, t = sel.nonzero(as_tuple=True)
        rows = self.row_of[b, t + shift]
        return self.probs[rows], (None if self.best is None else self.best[rows])


DataDirs = Path | Sequence[Path]


def load_examples(
    data: DataDirs, eval_examples: int, final_only: bool = False
) -> tuple[tuple[int, ...], list[Example], list[tuple[str, list[Example]]], list[Example]]:
    """(feature layers, train, [(directory name, its held-out)], all held out) from one or more
    shard directories with features (`datagen.hold_out`: the last `eval_examples` usable
    conversations of each are held out). A head that reads only the final state
    (`final_only`: Medusa, EAGLE-1) keeps that alone, whatever layers the sets store (they
    may differ), and the layers are ()."""
    dirs = [data] if isinstance(data, Path) else list(data)
    layers, sets = None, []
    for d in dirs:
        meta = shard_metadata(d)
        if "feature_layers" not in meta:
            raise DataError(
                f"{d} has no target features; regenerate it with "
                "`specdecode data generate --features eagle3` (the default)"
            )
        these = tuple(json.loads(meta["feature_layers"]))
        stored = len(these) + 1  # slices of the hidden size: the layer inputs, then the final
        if final_only:
            these = ()
        if layers is not None and these != layers:
            raise DataError(
                f"{d} stores features of layers {list(these)}, {dirs[0]} of {list(layers)}: "
                "data sets trained on together need the same layers"
            )
        layers = these
        examples = [e for e in iter_examples(d) if e.features is not None]
        examples = [e for e in examples if len(e.input_ids) >= 4]
        if final_only and stored > 1:
            for e in examples:
                width = e.features.shape[-1] // stored
                e.features = e.features[..., -width:].clone()
        if len(examples) <= eval_examples:
            raise DataError(
                f"{d} holds {len(examples)} usable examples; need more than "
                f"{eval_examples} (the last ones are held out)"
            )
        name = d.name if all(d.name != n for n, _ in sets) else str(d)
        sets.append((name, examples))
    train, held_sets, held = hold_out(sets, eval_examples)
    return layers, train, held_sets, held


class _Trainer:
    """What Medusa and EAGLE training share: data, draft vocabulary, soft targets, the loop."""

    def __init__(
        self,
        target: LlamaModel,
        data: DataDirs,
        cfg: HeadTrainConfig,
        eos_ids,
        final_only: bool = False,
    ):
        self.target, self.cfg = target, cfg
        self.signature = target_signature(target)  # recorded in the head's config.json
        self.device = target.norm.weight.device  # the head, its batches and labels live there
        # features are stored in bf16: an accelerator gets them so and widens them itself
        self._collate_dtype = torch.float32 if self.device.type == "cpu" else torch.bfloat16
        self.hidden = target.config.hidden_size
        self.feature_layers, self.train, self.held_sets, self.held = load_examples(
            data, cfg.eval_examples, final_only
        )
        # the features are the target's layer inputs and its final state, H each: data made
        # by another model (another hidden size or depth) would train a head on nonsense
        width = (len(self.feature_layers) + 1) * self.hidden
        if any(e.features.shape[-1] != width for e in self.train + self.held):
            raise DataError(
                f"the data's features are not this target's (layers {list(self.feature_layers)}"
                f" and the final state, {width} wide for hidden size {self.hidden}): train with "
                "the --model that generated the data"
            )
        # continuing: the earlier head (loaded once) keeps its own draft vocabulary
        self.init_head = None
        if cfg.init:
            from specdecode.models.head_io import load_head

            self.init_head = load_head(Path(cfg.init), target, cfg.allow_pickle)
            self.vocab_ids = self.init_head.vocab_ids
            if self.vocab_ids is not None:
                self.vocab_ids = self.vocab_ids.cpu()
        elif cfg.draft_vocab and cfg.draft_vocab < target.config.vocab_size:
            self.vocab_ids = frequent_tokens(
                self.train, cfg.draft_vocab, list(eos_ids), target.config.vocab_size
            )
        else:
            self.vocab_ids = None
        # (vocab_ids stays on the CPU, as saved; a copy on the device maps predictions)
        self._vocab_dev = None if self.vocab_ids is None else self.vocab_ids.to(self.device)
        lm = target.lm_head.weight.detach().float()
        self.lm_full = lm
        self.lm_rows = lm if self.vocab_ids is None else lm[self._vocab_dev]
        self.train_tokens = sum(sum(e.loss_mask) for e in self.train)
        self.coverage = answer_coverage(self.held, self.vocab_ids)
        self.gen = torch.Generator().manual_seed(cfg.seed)
        # label look-ahead padding
        self.extra = max(cfg.num_heads, cfg.eval_positions, cfg.ttt_steps) + 1
        self._order: list[int] = []
        self.progress = 0.0  # of the run, 0..1 (by steps or time, whichever is further)

    def final(self, feats: torch.Tensor) -> torch.Tensor:
        """The final feature (the last H columns; EAGLE-3 layer inputs come first)."""
        return feats[..., -self.hidden :]

    @torch.no_grad()
    def labels(self, batch: _Batch, top1: bool = False) -> _Targets:
        """The target's soft labels over the draft vocabulary (and, for evaluation, its
        full-vocabulary argmax), computed once per batch at the positions a loss reads (where
        the next token is an answer token) and shared by every head / draft step."""
        final = self.final(batch.feats)
        b, n = final.shape[:2]
        dev = final.device
        need = batch.valid[:, :n] & (torch.arange(n, device=dev)[None] < batch.rows[:, None])
        row_of = torch.full((b, n), -1, dtype=torch.long, device=dev)
        row_of[need] = torch.arange(int(need.sum()), device=dev)
        x = final[need]
        probs = F.linear(x, self.lm_rows).float().softmax(-1)
        best = F.linear(x, self.lm_full).argmax(-1) if top1 else None
        return _Targets(probs, best, row_of)

    def to_target_ids(self, idx: torch.Tensor) -> torch.Tensor:
        return idx if self._vocab_dev is None else self._vocab_dev[idx]

    def _rows(self, i: int) -> int:
        return min(self.cfg.max_len, self.train[i].features.shape[0])

    def next_batch(self, extra: int) -> _Batch:
        """About `batch_tokens` positions, padding included: a batch is padded to its longest
        example, and every tensor of the step (soft targets over the draft vocabulary, the
        unrolled layer's activations) scales with the padded size, so one long example among
        many short ones once took a 1.5B target's head past 24 GiB. The order is shuffled, then
        sorted by length within windows of 64 (examples of a batch have similar lengths)."""
        picked, longest = [], 0
        while True:
            if not self._order:
                perm = torch.randperm(len(self.train), generator=self.gen).tolist()
                self._order = [
                    i
                    for w in range(0, len(perm), 64)
                    for i in sorted(perm[w : w + 64], key=self._rows)
                ]
            r = self._rows(self._order[-1])
            if picked and (len(picked) + 1) * max(longest, r) > self.cfg.batch_tokens:
                break
            picked.append(self.train[self._order.pop()])
            longest = max(longest, r)
        return _collate(picked, self.cfg.max_len, extra, self._collate_dtype).to(self.device)

    def held_batches(self):
        for i in range(0, len(self.held), 8):
            held = self.held[i : i + 8]
            yield _collate(held, self.cfg.max_len, self.extra, self._collate_dtype).to(self.device)

    def _evaluate(self, evaluate) -> dict:
        """Held-out metrics on every set together, and per set when there are several."""
        out = evaluate()
        if len(self.held_sets) > 1:
            held, out["by_data_set"] = self.held, {}
            try:
                for name, examples in self.held_sets:
                    self.held = examples
                    out["by_data_set"][name] = evaluate()
            finally:
                self.held = held
        return out

    def run(self, module, loss_fn, evaluate, out_dir: Path, kind: str, info: dict) -> dict:
        from tqdm import tqdm

        cfg = self.cfg
        _large_allocations_via_mmap()
        params = [p for p in module.parameters() if p.requires_grad]
        # fused: one kernel per parameter instead of a dozen element-wise passes (AdamW's step
        # took 0.25-0.45 s of a 2.5-6 s step for a 1.5B target's EAGLE-3 head on 2 cores)
        fused = params[0].device.type in ("cpu", "cuda")
        opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0, betas=(0.9, 0.95), fused=fused)
        budget = cfg.max_minutes * 60 if cfg.max_minutes else None

        use_bf16 = default_bf16(self.device) if cfg.bf16 is None else cfg.bf16

        def autocast():
            return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=use_bf16)

        done, stopped, skipped, spent = 0, None, 0, 0.0
        position = 0  # the next step to run (past skipped ones, unlike `done`)
        if cfg.resume:  # where the saved run stopped (its "before" was measured then)
            done, position, skipped, spent, before = self._load_state(out_dir, params, opt, kind)
            if budget is not None and spent >= budget and position < cfg.steps:
                raise DataError(
                    f"the run in {out_dir} has used its time budget of {cfg.max_minutes:g} "
                    f"minutes ({spent / 60:.1f} trained; the budget counts the whole run): give "
                    "--max-minutes above that to go on"
                )
            history = {"before": before, "resumed_at_step": position}
            log.info("resuming %s at step %d of %d (%.0f s trained)", kind, position, cfg.steps,
                     spent)  # fmt: skip
        else:
            with autocast():
                history = {"before": self._evaluate(evaluate)}
        self._state_info = (kind, history["before"], params)
        t0 = time.perf_counter() - spent  # a resumed run's time counts on
        last_save = time.perf_counter()
        bar = tqdm(
            range(position, cfg.steps), desc=f"training {kind}", unit="step",
            initial=position, total=cfg.steps,
        )  # fmt: skip
        snapshot = None  # the data order and random streams before the step in flight
        try:
            for step in bar:
                position = step
                progress = step / cfg.steps
                if budget is not None:
                    progress = max(progress, (time.perf_counter() - t0) / budget)
                    if progress >= 1.0:
                        stopped = f"time budget of {cfg.max_minutes:g} minutes"
                        break
                lr = (
                    cfg.lr
                    * min(1.0, (step + 1) / cfg.warmup)
                    * 0.5
                    * (1 + math.cos(math.pi * progress))
                )
                for group in opt.param_groups:
                    group["lr"] = lr
                self.progress = progress
                snapshot = self._streams()
                with autocast():
                    loss, metrics = loss_fn(self.next_batch(extra=self.extra))
                if not torch.is_tensor(loss):  # no answer token within --max-len: skipped
                    skipped += 1
                    position, snapshot = step + 1, None
                    continue
                opt.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, 0.5)
                opt.step()
                done = position = step + 1
                snapshot = None
                bar.set_postfix(
                    loss=f"{loss.item():.3f}", **{k: f"{v:.2f}" for k, v in metrics.items()}
                )
                if (step + 1) % 200 == 0:
                    log.info("step %d: loss %.4f %s", step + 1, loss.item(), metrics)
                now = time.perf_counter()
                if cfg.checkpoint_minutes is not None and now - last_save >= (
                    cfg.checkpoint_minutes * 60
                ):
                    self._checkpoint(module, opt, out_dir, done, position, skipped, now - t0)
                    last_save = time.perf_counter()
        except KeyboardInterrupt:
            # Ctrl-C ends training like the time budget: evaluated and saved as it stands; the
            # step it cut short is run again on resuming (its batch back in the data order)
            stopped = "interrupt"
            if snapshot is not None:
                self._set_streams(snapshot)
        bar.close()
        if stopped:
            level = logging.WARNING if stopped == "interrupt" else logging.INFO
            log.log(level, "training stopped by %s after %d steps; saving the head", stopped, done)
        if skipped:
            log.warning("%d batches held no answer token within --max-len: skipped", skipped)
            if done == 0 and stopped is None:  # every step ran, none trained: no head
                raise DataError(
                    f"no batch held an answer token within --max-len {cfg.max_len} (answers "
                    "follow their prompts): nothing was trained; raise --max-len"
                )
        history["steps_done"] = done
        history["steps_skipped"] = skipped
        history["stopped_by"] = stopped or "steps"
        seconds = time.perf_counter() - t0
        history["train_seconds"] = round(seconds, 1)
        with autocast():
            history["after"] = self._evaluate(evaluate)
        history.update(
            train_examples=len(self.train),
            train_answer_tokens=self.train_tokens,
            held_out_examples=len(self.held),
            draft_vocab_coverage=round(self.coverage, 4),
            config={**self._recorded_config(), "bf16": use_bf16},
            **info,
        )
        save_head(module, out_dir, self.target.config, {"training": history}, self.signature)
        self._save_state(opt, out_dir, done, position, skipped, seconds)
        (out_dir / "training.json").write_text(json.dumps(history, indent=2))
        return history

    def _recorded_config(self) -> dict:
        """The settings, with the draft vocabulary the head has (0: the full one): a continued
        head keeps its own, and one at least the vocabulary's size is the full one, whatever
        --draft-vocab said."""
        out = asdict(self.cfg)
        out["draft_vocab"] = 0 if self.vocab_ids is None else int(self.vocab_ids.numel())
        return out

    def _checkpoint(self, module, opt, out_dir: Path, done, position, skipped, seconds: float):
        """The head as it stands, loadable (`--init` continues from it, `--resume` continues
        the run), replaced at the end."""
        info = {"checkpoint": True, "steps_done": done, "train_seconds": round(seconds, 1)}
        info["config"] = self._recorded_config()
        save_head(module, out_dir, self.target.config, {"training": info}, self.signature)
        self._save_state(opt, out_dir, done, position, skipped, seconds)
        (out_dir / "training.json").write_text(json.dumps(info, indent=2))
        log.info("checkpoint after %d steps written to %s", done, out_dir)

    def _streams(self) -> dict:
        """The data order still to come and the random streams (CPU; the device's)."""
        out = {"order": list(self._order), "data": self.gen.get_state()}
        out["torch"] = torch.get_rng_state()
        if self.device.type == "cuda":  # EAGLE-1's feature noise is drawn there
            out["cuda"] = torch.cuda.get_rng_state(self.device)
        return out

    def _set_streams(self, streams: dict) -> None:
        self._order = list(streams["order"])
        self.gen.set_state(streams["data"])
        torch.set_rng_state(streams["torch"])
        if "cuda" in streams and self.device.type == "cuda":
            torch.cuda.set_rng_state(streams["cuda"], self.device)

    def _save_state(self, opt, out_dir: Path, done, position, skipped, seconds: float) -> None:
        """What `resume` needs beyond the head's file (saved just before, with the same
        `steps_done`): see `train.state`."""
        kind, before, params = self._state_info
        streams = self._streams()
        tensors = {"data.order": torch.tensor(streams.pop("order"), dtype=torch.long)}
        tensors.update({f"rng.{k}": v for k, v in streams.items()})
        state = {
            "kind": kind,
            "steps_done": done,
            "next_step": position,
            "steps_skipped": skipped,
            "train_seconds": seconds,
            "config": self._recorded_config(),
            "before": before,
            "train_examples": len(self.train),
            "train_ids": train_digest(self.train),
        }
        write_state(out_dir, params, opt, tensors, state)

    def _load_state(self, out_dir: Path, params, opt, kind: str):
        """Restore what `_save_state` wrote: (steps done, skipped, seconds, `before` metrics)."""
        state, tensors = read_state(out_dir)
        head_cfg = json.loads((out_dir / "config.json").read_text())
        head_steps = head_cfg.get("specdecode_head", {}).get("training", {}).get("steps_done")
        if head_steps != state["steps_done"]:  # killed between the two writes: the state
            log.warning(  # holds the weights of its own step, which the run goes on from
                "%s: the head file is of step %s, the trainer state of step %s: resuming from "
                "the trainer state", out_dir, head_steps, state["steps_done"],
            )  # fmt: skip
        path = out_dir / STATE_FILE
        if state["kind"] != kind or state["param_shapes"] != [list(p.shape) for p in params]:
            raise DataError(f"{path} was saved by another kind or shape of head")
        ids = train_digest(self.train)
        same = state.get("train_ids", ids) == ids  # (states written before it: the count only)
        if state["train_examples"] != len(self.train) or not same:
            raise DataError(
                f"{path} was trained on {state['train_examples']} examples, this --data has "
                f"{len(self.train)}"
                + ("" if same else " (other ones, or in another order)")
                + ": resume with the same data, in the same order (--init trains on other data)"
            )
        restore(params, opt, tensors, state)
        streams = {k[4:]: v for k, v in tensors.items() if k.startswith("rng.")}
        self._set_streams({"order": tensors["data.order"].tolist(), **streams})
        return (
            state["steps_done"],
            state["next_step"],
            state["steps_skipped"],
            state["train_seconds"],
            state["before"],
        )


def _large_allocations_via_mmap() -> None:
    """glibc raises its mmap threshold each time a large block is freed, after which training's
    large, varying-size tensors come from the heap, whose holes are never returned: the Qwen
    EAGLE-3 run grew by ~0.5 GB a minute that way. A fixed 1 MiB threshold keeps every large
    tensor in its own mapping, returned to the system when freed. No-op off glibc."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if name is None:
        return
    try:
        libc = ctypes.CDLL(name)
        libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        return


def default_bf16(device: torch.device) -> bool:
    """`--precision auto`: bf16 autocast on CUDA (where the GPU has bf16), on a CPU only where
    it multiplies bf16 natively."""
    if device.type == "cuda":  # native bf16 from Ampere on (is_bf16_supported counts emulation)
        return torch.cuda.get_device_capability(device)[0] >= 8
    return device.type == "cpu" and native_bf16_matmul()


def native_bf16_matmul() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512-BF16 or AMX-BF16)."""
    from specdecode.kernels import _cpu_flags

    return bool({"avx512_bf16", "amx_bf16"} & _cpu_flags())


def _soft_ce(logits: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    return -(p * logits.float().log_softmax(-1)).sum(-1)


# ---- Medusa -------------------------------------------------------------------------------------


def train_medusa(
    target: LlamaModel, data: DataDirs, out_dir: Path, cfg: HeadTrainConfig, eos_ids
) -> dict:
    torch.manual_seed(cfg.seed)
    tr = _Trainer(target, data, cfg, eos_ids, final_only=True)
    # a continued head keeps its own number of heads and blocks (as EAGLE keeps its layer's
    # shape); --num-heads shapes new ones
    init = tr.init_head
    if isinstance(init, MedusaHeads):
        shape = (init.num_heads, len(init.medusa_head[0]))
    else:
        shape = (cfg.num_heads, 1)
    heads = MedusaHeads(tr.hidden, *shape).to(tr.device)
    heads.attach(tr.lm_rows, None)  # rows already restricted
    heads.vocab_ids = tr.vocab_ids
    if cfg.init:
        _continue_from(heads, tr, tr.vocab_ids)
    k = heads.num_heads

    def outputs(batch: _Batch, top1: bool = False):
        """Per head j: (logits [N, Vd] at its trained positions, soft targets [N, Vd], the
        target's argmax [N] when `top1`)."""
        final = tr.final(batch.feats)
        n = final.shape[1]
        targets = tr.labels(batch, top1)
        t = torch.arange(n, device=final.device)[None]
        for j in range(k):
            # head j at t predicts token t+2+j, whose distribution is the target's at t+1+j
            s = 1 + j
            sel = batch.valid[:, s : n + s] & (t + s < batch.rows[:, None])
            x = heads.medusa_head[j](final[sel])
            yield (j, heads.proj(x), *targets.at(sel, s))

    def loss_fn(batch: _Batch):
        total, metrics = 0.0, {}
        for j, lg, p, _ in outputs(batch):
            if lg.shape[0] == 0:
                continue
            total = total + 0.8**j * _soft_ce(lg, p).mean()
            if j == 0:
                metrics["top1_h0"] = (lg.argmax(-1) == p.argmax(-1)).float().mean().item()
        return total, metrics

    @torch.no_grad()
    def evaluate() -> dict:
        hits, counts, loss = [0.0] * k, [0] * k, 0.0
        for batch in tr.held_batches():
            for j, lg, p, want in outputs(batch, top1=True):
                if lg.shape[0] == 0:
                    continue
                loss += 0.8**j * _soft_ce(lg, p).sum().item()
                hits[j] += (tr.to_target_ids(lg.argmax(-1)) == want).sum().item()
                counts[j] += lg.shape[0]
        return _held_out("loss", loss, hits, counts, "top1_per_head")

    return tr.run(heads, loss_fn, evaluate, out_dir, "medusa", {"num_heads": k})


# ---- EAGLE --------------------------------------------------------------------------------------


def train_eagle(
    target: LlamaModel, data: DataDirs, out_dir: Path, cfg: HeadTrainConfig, eos_ids
) -> dict:
    torch.manual_seed(cfg.seed)
    tr = _Trainer(target, data, cfg, eos_ids, final_only=True)
    # continuing a head whose fc has a bias (SafeAILab's EAGLE-1 layout) keeps it
    prev_fc = getattr(tr.init_head, "fc", None)
    head = EagleHead(_layer_config(target, tr), fc_bias=getattr(prev_fc, "bias", None) is not None)
    if not cfg.init:  # a continued head takes every weight from its earlier run
        _identity_start(head, target)
    head = head.float().to(tr.device)
    head.attach(target.embed_tokens, tr.lm_rows, None)
    head.vocab_ids = tr.vocab_ids
    if cfg.init:
        _continue_from(head, tr, tr.vocab_ids)
    target.embed_tokens.requires_grad_(False)

    def loss_fn(batch: _Batch):
        final = tr.final(batch.feats)
        n = final.shape[1]
        noisy = final + (torch.rand_like(final) * 2 - 1) * cfg.noise
        pred = head.forward_dense(batch.nxt[:, :n], noisy)  # [B, L, H]: f'_{t+1}
        # trained where f_{t+1} exists and token t+2 is an answer token
        t = torch.arange(n, device=final.device)[None]
        sel = batch.valid[:, 1 : n + 1] & (t + 1 < batch.rows[:, None])
        if not sel.any():  # no answer token within --max-len: nothing to learn (skipped)
            return 0.0, {}
        p_pred = pred[sel]
        p_true = F.pad(final, (0, 0, 0, 1))[:, 1 : n + 1][sel]
        reg = F.smooth_l1_loss(p_pred.float(), p_true)
        p = tr.labels(batch).at(sel, 1)[0]
        logits = head.logits(p_pred)
        ce = _soft_ce(logits, p).mean()
        top1 = (logits.argmax(-1) == p.argmax(-1)).float().mean().item()
        return reg + cfg.ce_weight * ce, {"reg": reg.item(), "ce": ce.item(), "top1": top1}

    evaluate = _unrolled_evaluation(tr, head, tr.final)
    return tr.run(head, loss_fn, evaluate, out_dir, "eagle", {})


@torch.no_grad()
def _identity_start(head: EagleHead, target: LlamaModel) -> None:
    """Start EAGLE-1 as the identity on the feature: fc = [0 | I], and the decoder layer (the
    target's last layer, same shapes) with its output projections zeroed, so the first
    prediction of f_{t+1} is f_t, already in the LM head's input space. A random fc feeds the
    layer off-scale inputs and its raw output, projected by the frozen LM head, gives logits of
    the wrong magnitude (cross-entropy in the hundreds) that a short run never recovers from."""
    h = head.config.hidden_size
    src, dst = target.layers[-1], head.layers[0]
    # q/k/v only: o_proj starts at zero, and a Qwen3 target's q/k norms have no place in the
    # head's Llama layer
    dst.self_attn.qkv_proj.load_state_dict(src.self_attn.qkv_proj.state_dict())
    _silenced_copy(dst, src)
    if head.fc.bias is not None:
        head.fc.bias.zero_()
    head.fc.weight.zero_()
    head.fc.weight[:, h : 2 * h].copy_(torch.eye(h))


def _silenced_copy(dst, src) -> None:
    """The target layer's MLP and post-attention norm into the head's layer, with both output
    projections (o_proj, down_proj) zeroed: the layer starts as the identity on its residual."""
    dst.mlp.load_state_dict(src.mlp.state_dict())
    dst.post_attention_layernorm.load_state_dict(src.post_attention_layernorm.state_dict())
    for lin in (dst.self_attn.o_proj, dst.mlp.down_proj):
        lin.weight.zero_()
        if lin.bias is not None:
            lin.bias.zero_()


def _unrolled_steps(tr: _Trainer, head, batch: _Batch, inputs, steps: int, top1: bool = False):
    """Per unrolled draft step j: (logits [N, Vd], soft targets [N, Vd], the target's argmax
    [N] when `top1`). Step j at origin t predicts token t+j+2 (the target's f_{t+j+1})."""
    n = batch.feats.shape[1]
    targets = tr.labels(batch, top1)
    preds = head.forward_unrolled(batch.nxt, inputs(batch.feats), steps)
    t = torch.arange(n, device=batch.feats.device)[None]
    for j, pred in enumerate(preds):
        s = j + 1
        sel = batch.valid[:, s : n + s] & (t + s < batch.rows[:, None])
        yield (j, head.logits(pred[sel]), *targets.at(sel, s))


def _unrolled_evaluation(tr: _Trainer, head, inputs):
    @torch.no_grad()
    def evaluate() -> dict:
        steps = tr.cfg.eval_positions
        hits, counts, ce_sum = [0.0] * steps, [0] * steps, 0.0
        for batch in tr.held_batches():
            for j, lg, p, want in _unrolled_steps(tr, head, batch, inputs, steps, top1=True):
                if j == 0:
                    ce_sum += _soft_ce(lg, p).sum().item()
                hits[j] += (tr.to_target_ids(lg.argmax(-1)) == want).sum().item()
                counts[j] += lg.shape[0]
        return _held_out("ce", ce_sum, hits, counts, "top1_per_step")

    return evaluate


def _held_out(name: str, total: float, hits: list, counts: list, top1: str) -> dict:
    """Held-out metrics: the mean loss over the first position's tokens and top-1 per
    position, None where no token was evaluated (no held-out answer within --max-len: a mean
    of nothing is not a loss of 0), and how many tokens each is over."""
    if counts[0] == 0:
        log.warning("the held-out examples hold no answer token within --max-len: no metrics")
    return {
        name: round(total / counts[0], 4) if counts[0] else None,
        top1: [round(h / c, 4) if c else None for h, c in zip(hits, counts, strict=True)],
        "held_out_tokens": counts[0],
    }


def ttt_steps_at(progress: float, steps: int, ramp: float) -> int:
    """Draft steps unrolled at `progress` (0..1) of the run (see `HeadTrainConfig.ttt_ramp`)."""
    if ramp <= 0 or progress >= ramp or steps <= 1:
        return steps
    return 1 + int(progress / ramp * (steps - 1))


# ---- EAGLE-3 ------------------------------------------------------------------------------------


def train_eagle3(
    target: LlamaModel, data: DataDirs, out_dir: Path, cfg: HeadTrainConfig, eos_ids
) -> dict:
    """Training-time test: `ttt_steps` draft steps unrolled (each fed the previous step's
    output, attending to the earlier steps' keys at the same origin), loss = sum_j 0.8^j x soft
    CE against the target's distribution over the draft vocabulary; no regression loss."""
    torch.manual_seed(cfg.seed)
    tr = _Trainer(target, data, cfg, eos_ids)
    layers = tr.feature_layers
    if len(layers) < 2:
        raise DataError(
            f"the data stores features of layers {list(layers)}; EAGLE-3 needs the low/mid/high "
            "layer inputs (`specdecode data generate --features eagle3`)"
        )
    vocab = tr.vocab_ids if tr.vocab_ids is not None else torch.arange(target.config.vocab_size)
    head = Eagle3Head(_layer_config(target, tr), vocab.numel(), layers)
    asked = variant_flags(cfg.variant)
    if isinstance(tr.init_head, Eagle3Head):  # a continued head keeps its variant
        if cfg.variant and asked != tr.init_head.variant:
            raise DataError(
                f"{cfg.init} is a head with {tr.init_head.variant}; a continued head keeps its "
                "variant (leave --variant out)"
            )
        asked = tr.init_head.variant
    head.set_variant(**asked)
    if not cfg.init:  # a continued head takes every weight from its earlier run
        _identity_start3(head, target, tr.lm_rows)
    head = head.float().to(tr.device)
    if cfg.init:
        _continue_from(head, tr, vocab)
    head.attach(target.embed_tokens, vocab)
    target.embed_tokens.requires_grad_(False)
    nfeat = head.feature_size

    def inputs(feats: torch.Tensor) -> torch.Tensor:
        return feats[..., :nfeat]

    def loss_fn(batch: _Batch):
        total, metrics = 0.0, {}
        steps = ttt_steps_at(tr.progress, cfg.ttt_steps, cfg.ttt_ramp)
        metrics["ttt"] = steps
        for j, lg, p, _ in _unrolled_steps(tr, head, batch, inputs, steps):
            if lg.shape[0] == 0:
                continue
            ce = _soft_ce(lg, p).mean()
            total = total + 0.8**j * ce
            if j == 0:  # the first step's, as the held-out "ce" (loss weighs every step)
                metrics["ce"] = ce.item()
            if j in (0, steps - 1):
                metrics[f"top1_s{j}"] = (lg.argmax(-1) == p.argmax(-1)).float().mean().item()
        return total, metrics

    evaluate = _unrolled_evaluation(tr, head, inputs)
    return tr.run(head, loss_fn, evaluate, out_dir, "eagle3", {"aux_layers": list(layers)})


def variant_flags(spec: str) -> dict[str, bool]:
    """`--variant norm_before_fc,norm_output` -> `Eagle3Head.set_variant`'s flags."""
    names = set(EAGLE3_VARIANTS)
    given = [x.strip() for x in spec.split(",") if x.strip()]
    unknown = sorted(set(given) - names)
    if unknown:
        raise DataError(f"unknown EAGLE-3 variant {unknown}; choose from {sorted(names)}")
    if {"norm_before_fc", "fc_norm"} <= set(given):
        raise DataError("norm_before_fc and fc_norm exclude each other")
    return {name: name in given for name in sorted(names)}


@torch.no_grad()
def _identity_start3(head: Eagle3Head, target: LlamaModel, lm_rows: torch.Tensor) -> None:
    """EAGLE-3's counterpart of `_identity_start`: fc = [0 | 0 | I] passes the high feature
    (the input of layer N-3, the nearest the LM head's input space), the decoder layer is the
    target's last layer (its hidden-state half of the attention input; the embedding half small
    and random) with its output projections zeroed, and the final norm and LM head (the draft
    vocabulary's rows) are the target's. A random fc (the start until 2026-12) began at a
    soft cross-entropy of 12 and was still at 5.3 after 154 steps on Qwen2.5-Coder-1.5B."""
    h = head.config.hidden_size
    src, dst = target.layers[-1], head.layers[0]
    dst.self_attn.qkv_proj.weight[:, h:].copy_(src.self_attn.qkv_proj.weight)  # (any device)
    dst.self_attn.qkv_proj.weight[:, :h].normal_(0, 0.02)
    if src.self_attn.qkv_proj.bias is not None:
        dst.self_attn.qkv_proj.bias.copy_(src.self_attn.qkv_proj.bias)
    dst.hidden_norm.load_state_dict(src.input_layernorm.state_dict())
    _silenced_copy(dst, src)
    head.fc.weight.zero_()
    head.fc.weight[:, -h:].copy_(torch.eye(h))
    if head.fc.bias is not None:
        head.fc.bias.zero_()
    head.norm.load_state_dict(target.norm.state_dict())
    head.lm_head.weight.copy_(lm_rows)


def _layer_config(target: LlamaModel, tr: _Trainer):
    """The decoder layer of the EAGLE head this run trains: a head continued (`--init`) keeps
    its own layer's shape; a new one gets the target's as a Llama layer (no Qwen3 q/k norms:
    vLLM and SGLang load EAGLE heads as Llama layers, so every head trained here exports)."""
    from dataclasses import replace

    prev = getattr(tr.init_head, "config", None)
    if prev is not None:
        return replace(prev, num_layers=target.config.num_layers)
    return replace(target.config, qk_norm=False)


def _continue_from(head, tr: _Trainer, vocab: torch.Tensor | None) -> None:
    """Load the weights of the earlier run of the same head (`--init`; training continues
    from them)."""
    prev = tr.init_head
    a, b = prev.vocab_ids, vocab
    if (a is None) != (b is None):  # no draft vocabulary means all of the target's ids
        a, b = (torch.arange(tr.target.config.vocab_size) if v is None else v for v in (a, b))
    same_vocab = a is None or torch.equal(a.cpu(), b.cpu())
    if type(prev) is not type(head):
        raise DataError(
            f"{tr.cfg.init} holds another kind of head ({type(prev).__name__}) than this run "
            f"trains ({type(head).__name__})"
        )
    if not same_vocab:
        raise DataError(f"{tr.cfg.init} has another draft vocabulary than this run's")
    if getattr(prev, "own_projections", None) is not None:
        raise DataError(
            f"{tr.cfg.init} has its own vocabulary projections per head (a FasterDecoding or "
            "vLLM Medusa checkpoint); heads trained here project with the target's LM head, "
            "so continuing it would drop them: train a new head instead"
        )
    for attr in ("aux_layers", "variant"):  # EAGLE-3: what the features mean
        if getattr(prev, attr, None) != getattr(head, attr, None):
            raise DataError(
                f"{tr.cfg.init} has {attr} {getattr(prev, attr)}, this run "
                f"{getattr(head, attr)}: continue it on data with the same feature layers"
            )
    head.load_state_dict({k: v.float() for k, v in prev.state_dict().items()})
