"""Self-distillation data: the target regenerates the assistant turns of training chats.

Heads and draft models learn the target's own distribution (training on someone else's answers,
or without the target's chat template, is a known cause of low acceptance). For each ShareGPT
*train* conversation the first user turn is wrapped in the target's chat template and the target
answers it; the shard stores the token ids of prompt + answer and a loss mask that is 1 on the
answer's tokens only.

Shards (`shard-00000.safetensors`, ...) hold a fixed range of conversations, are written
atomically and skipped when present, so an interrupted run resumes where it stopped. Each shard
records the conversation ids of its range (`slice_ids`, the ones whose prompts were too long
included): a run over more conversations regenerates a last shard that was only partly filled,
and a different `--shard-size` over the same directory is refused (its ranges would not match).
Shards written before ranges were recorded are trusted when their ids fall in the range.
Under `torchrun` each rank takes the shards with index % WORLD_SIZE == RANK, and checks every
shard already there (the other ranks' too) against its flags: one directory is one run's answers
(`shard_metadata`, which training reads, refuses a directory whose shards differ).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError

from specdecode.errors import DataError, InvalidRequestError

log = logging.getLogger(__name__)


@dataclass
class Example:
    conversation_id: str
    input_ids: list[int]  # prompt + answer
    loss_mask: list[int]  # 1 on the answer's tokens (what the target generated)
    # [len(input_ids) - 1, F] target features at every token but the last, if recorded
    features: torch.Tensor | None = None


def shard_path(out: Path, index: int) -> Path:
    return out / f"shard-{index:05d}.safetensors"


def write_shard(
    path: Path, examples: list[Example], metadata: dict, features: list[torch.Tensor] | None = None
) -> None:
    """`features[i]`: [len(examples[i].input_ids) - 1, F], the target's features at every token
    but the last (stored as `features` with the same offsets minus one per example)."""
    from specdecode.models.loader import write_safetensors

    offsets = [0]
    for ex in examples:
        offsets.append(offsets[-1] + len(ex.input_ids))
    tensors = {
        "input_ids": torch.tensor([t for ex in examples for t in ex.input_ids], dtype=torch.int32),
        "loss_mask": torch.tensor([m for ex in examples for m in ex.loss_mask], dtype=torch.uint8),
        "offsets": torch.tensor(offsets, dtype=torch.int64),
    }
    if features is not None:
        for ex, f in zip(examples, features, strict=True):
            if f.shape[0] != len(ex.input_ids) - 1:
                raise ValueError(
                    f"{ex.conversation_id}: {f.shape[0]} feature rows for "
                    f"{len(ex.input_ids)} tokens (expected one fewer)"
                )
        tensors["features"] = (
            torch.cat(features) if features else torch.zeros(0, 1, dtype=torch.bfloat16)
        )
    meta = {**metadata, "conversation_ids": json.dumps([ex.conversation_id for ex in examples])}
    write_safetensors(tensors, path, {k: str(v) for k, v in meta.items()})


@contextmanager
def _readable(path: Path) -> Iterator[None]:
    """A shard that cannot be read (truncated, not a shard, fields missing) is a DataError
    naming it, not a traceback from deep in safetensors."""
    try:
        yield
    except (OSError, ValueError, KeyError, TypeError, SafetensorError) as e:
        raise DataError(
            f"{path}: not a readable data shard ({type(e).__name__}: {e}); delete it and rerun "
            "`specdecode data generate` with the same flags (it regenerates missing shards)"
        ) from e


def read_shard(path: Path, features: bool = True) -> list[Example]:
    from safetensors import safe_open

    with _readable(path), safe_open(str(path), framework="pt") as f:
        ids, mask, offsets = (f.get_tensor(k) for k in ("input_ids", "loss_mask", "offsets"))
        conv_ids = json.loads(f.metadata()["conversation_ids"])
        feats = f.get_tensor("features") if features and "features" in f.keys() else None
        rows = len(ids) - len(conv_ids)  # (features: one row fewer than tokens per example)
        if len(offsets) != len(conv_ids) + 1 or not int(offsets[-1]) == len(ids) == len(mask):
            raise ValueError("its offsets do not match its tokens")
        if feats is not None and feats.shape[0] != rows:
            raise ValueError(f"{feats.shape[0]} feature rows for {rows}")
    out = []
    for i, cid in enumerate(conv_ids):
        a, b = int(offsets[i]), int(offsets[i + 1])
        fe = feats[a - i : b - i - 1] if feats is not None else None
        out.append(Example(cid, ids[a:b].tolist(), mask[a:b].tolist(), fe))
    return out


def shard_paths(data_dir: Path) -> list[Path]:
    """The shards of a data directory, in order; an error when there are none."""
    if not data_dir.is_dir():
        raise DataError(f"data directory {data_dir} does not exist")
    paths = sorted(data_dir.glob("shard-*.safetensors"))
    if not paths:
        raise DataError(f"no shards in {data_dir} (run `specdecode data generate`)")
    return paths


def _metadata(path: Path) -> dict:
    """A shard's metadata (the header only, no tensor read)."""
    from safetensors import safe_open

    with _readable(path), safe_open(str(path), framework="pt") as f:
        meta = dict(f.metadata() or {})
        json.loads(meta["conversation_ids"])
        return meta


# what every shard of one data set records alike: the flags `generate` checks a resumed run
# against, and the features (descriptions such as `source` are not compared)
_SETTINGS = (
    "model", "max_tokens", "temperature", "max_prompt_tokens", "shard_size", "quantization",
)  # fmt: skip


def shard_metadata(data_dir: Path) -> dict:
    """The settings the shards of `data_dir` were generated with (headers only); an error
    where two shards differ (a directory two runs with other flags wrote into: under torchrun
    each rank checks only the shards it writes)."""
    paths = shard_paths(data_dir)
    first = _metadata(paths[0])
    for path in paths[1:]:
        meta = _metadata(path)
        # (a setting an older shard did not record is not compared; features always are)
        keys = {k for k in _SETTINGS if k in first and k in meta} | {"feature_layers"}
        differ = sorted(k for k in keys if meta.get(k) != first.get(k))
        if differ:
            what = ", ".join(f"{k} {meta.get(k)} (vs {first.get(k)})" for k in differ)
            raise DataError(
                f"{path.name} was generated with other settings than {paths[0].name} in "
                f"{data_dir}: {what}; one data set is one run's answers: regenerate it with "
                "one set of flags"
            )
    return first


def answered_ids(data_dir: Path) -> set[str]:
    """The conversation ids stored in a shard directory (read from the shards' metadata)."""
    ids: set[str] = set()
    for path in shard_paths(data_dir):
        ids.update(json.loads(_metadata(path)["conversation_ids"]))
    return ids


def first_of_each(examples: list[Example]) -> list[Example]:
    """Each conversation once, where it first appears (overlapping sets hold some twice: held
    out by both, it would count twice in the held-out metrics)."""
    seen: set[str] = set()
    return [e for e in examples if not (e.conversation_id in seen or seen.add(e.conversation_id))]


def hold_out(
    sets: list[tuple[str, list[Example]]], n: int
) -> tuple[list[Example], list[tuple[str, list[Example]]], list[Example]]:
    """Several named data sets -> (train, [(name, its held-out)], all held out): the last `n`
    examples of each are held out; training takes the rest less every conversation held out
    anywhere, each conversation once, and the held-out ones together count each once."""
    held = [(name, examples[-n:]) for name, examples in sets]
    train = [e for _, examples in sets for e in examples[:-n]]
    every = [e for _, exs in held for e in exs]
    return drop_held_and_repeats(train, every), held, first_of_each(every)


def drop_held_and_repeats(train: list[Example], held: list[Example]) -> list[Example]:
    """The training examples of several data sets less every conversation held out in any of
    them, each conversation once (sets drawn from the same source overlap: a held-out
    conversation trained on through another set would leak into the held-out metrics)."""
    seen = {e.conversation_id for e in held}
    kept = []
    for e in train:
        if e.conversation_id not in seen:
            seen.add(e.conversation_id)
            kept.append(e)
    return kept


def iter_examples(data_dir: Path, features: bool = True) -> Iterator[Example]:
    for path in sorted(data_dir.glob("shard-*.safetensors")):
        yield from read_shard(path, features)


def _check_settings(
    path: Path, feature_layers: str | None, settings: dict | None, mine: bool = True
) -> dict | None:
    """The metadata of the shard at `path`, where it was written with this run's features and
    settings (an error otherwise); None for a shard that cannot be read (`mine`: this rank
    regenerates it, else the rank it belongs to does)."""
    try:
        meta = _metadata(path)
    except DataError as e:  # (damaged after it was written: writes are atomic)
        who = "regenerating it" if mine else "the rank it belongs to regenerates it"
        log.warning("%s is not a readable data shard (%s): %s", path, e.__cause__, who)
        return None
    stored = meta.get("feature_layers")
    if stored != feature_layers:
        raise InvalidRequestError(
            f"{path} stores target features of layers {stored or 'none'}, this run "
            f"{feature_layers or 'none'}: use the same --features as the run that wrote it, or "
            "another --out"
        )
    # one data set is one run's answers: a rerun with another model, length or temperature
    # would mix them without a word (settings an older shard did not record are not compared)
    differ = [
        f"{k} {meta[k]} (this run: {v})"
        for k, v in (settings or {}).items()
        if k in meta and meta[k] != v
    ]
    if differ:
        raise InvalidRequestError(
            f"{path} was generated with {', '.join(differ)}: use the same flags as the run that "
            "wrote it, or another --out"
        )
    return meta


def _shard_done(
    path: Path, want: list[str], feature_layers: str | None = None, settings: dict | None = None
) -> bool:
    """Whether the shard at `path` holds the range `want`; False (to regenerate) for a range it
    holds only the start of (a run extended past a partly filled last shard); an error for a
    range that does not match (another shard size or conversation list in the same place)."""
    if not path.exists():
        return False
    meta = _check_settings(path, feature_layers, settings)
    if meta is None:
        return False
    held = json.loads(meta["conversation_ids"])
    recorded = json.loads(meta["slice_ids"]) if "slice_ids" in meta else None
    if recorded is None:  # an older shard: the ids it holds must come from this range
        if set(held) <= set(want):
            return True
        recorded = held
    if recorded[: len(want)] == want:  # the range, or more of it (a longer run wrote it)
        return True
    if recorded == want[: len(recorded)]:
        log.info("%s holds %d of its %d conversations: regenerating it", path.name,
                 len(recorded), len(want))  # fmt: skip
        return False
    raise InvalidRequestError(
        f"{path} holds another range of conversations than this run puts there ({len(recorded)} "
        f"from {recorded[0]!r}, this run {len(want)} from {want[0]!r}): a different "
        "--shard-size or conversation list? Use the same flags as the run that wrote it, or "
        "another --out"
    )


def _seed(conversation_id: str) -> int:
    """A per-conversation seed that is the same in every process (unlike `hash`)."""
    return int(hashlib.sha256(conversation_id.encode()).hexdigest()[:8], 16)


def rank_and_world() -> tuple[int, int]:
    """torchrun sets RANK and WORLD_SIZE; a plain run is rank 0 of 1."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def default_feature_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's low, mid and high layers (the final feature is always stored too)."""
    from specdecode.models.heads import eagle3_aux_layers

    return eagle3_aux_layers(num_layers)


class _FeatureRecorder:
    """Collects, per sequence, the target features the engine computed at each fed token (a
    preempted sequence is recomputed from position 0, which restarts its record)."""

    def __init__(self) -> None:
        self.rows: dict[int, list[torch.Tensor]] = {}

    def __call__(self, seqs, feats) -> None:
        # kept on the CPU (a shard's features would otherwise pile up on an accelerator),
        # copied there in one transfer per step
        sizes = [len(f) for f in feats]
        host = torch.cat(feats).to(torch.bfloat16).cpu().split(sizes) if feats else ()
        for seq, f in zip(seqs, host, strict=True):
            if seq.blocks.length - len(f) == 0:
                self.rows[seq.seq_id] = []
            self.rows[seq.seq_id].append(f)

    def pop(self, seq_id: int) -> torch.Tensor:
        return torch.cat(self.rows.pop(seq_id))


def generate(
    llm,
    conversations: list[tuple[str, list[dict]]],
    out: Path,
    shard_size: int = 64,
    max_tokens: int = 256,
    temperature: float = 0.0,
    max_prompt_tokens: int = 512,
    feature_layers: tuple[int, ...] | None = None,
    source: str = "sharegpt",
) -> list[Path]:
    """Answer each conversation's first user turn with the target; write this rank's shards.

    All of this rank's remaining requests go to the engine at once (it batches up to
    `max_num_seqs`), and a shard is written as soon as its last conversation finishes, so the
    batch stays full. With `feature_layers` (see `ModelRunner.feature_layers`) each shard also
    stores the target's features at every token but the last (bf16): the heads train on them
    without a second pass of the target.
    """
    from tqdm import tqdm

    from specdecode.sampling import SamplingParams

    out.mkdir(parents=True, exist_ok=True)
    rank, world = rank_and_world()
    num_shards = -(-len(conversations) // shard_size)
    mine = [i for i in range(num_shards) if i % world == rank]

    def ids_of(i: int) -> list[str]:
        return [cid for cid, _ in conversations[i * shard_size : (i + 1) * shard_size]]

    engine = llm.engine
    meta = {
        "model": str(engine.model_path.name),
        "max_tokens": max_tokens,
        "temperature": temperature,
        "max_prompt_tokens": max_prompt_tokens,
        "source": f"{source} (train split), first user turn",
    }
    meta["shard_size"] = shard_size  # (which range each shard holds: another size is refused)
    meta["quantization"] = str(engine.config.quantization)  # (the target that answered)
    settings = {k: str(meta[k]) for k in _SETTINGS}
    layers = json.dumps(list(feature_layers)) if feature_layers is not None else None
    # every shard there, the other ranks' too: each rank would otherwise check only its own,
    # and a directory could end up holding two runs' answers
    own = {shard_path(out, i) for i in mine}
    others = [p for p in sorted(out.glob("shard-*.safetensors")) if p not in own]
    for path in others:
        _check_settings(path, layers, settings, mine=False)
    todo = [i for i in mine if not _shard_done(shard_path(out, i), ids_of(i), layers, settings)]
    if len(todo) < len(mine):
        log.info("resuming: %d of %d shards already written", len(mine) - len(todo), len(mine))
    recorder = None
    drafter_layers = engine.runner.feature_layers  # a feature-reading drafter's, or None
    if feature_layers is not None:
        if drafter_layers is not None and tuple(feature_layers) != tuple(drafter_layers):
            raise InvalidRequestError(
                f"this engine's drafter reads features of layers {list(drafter_layers)}; "
                f"the data would store {list(feature_layers)}: generate data on an engine "
                "without speculation (or with the same layers)"
            )
        meta["feature_layers"] = json.dumps(list(feature_layers))
        engine.runner.feature_layers = tuple(feature_layers)
        recorder = _FeatureRecorder()
        engine.feature_observers.append(recorder)
    caching = engine.manager.prefix_caching
    # every position's features are stored: none may come from a cached prefix
    engine.manager.prefix_caching = caching and recorder is None
    waiting: dict[int, list] = {}  # shard -> [(conversation id, prompt ids, Sequence)]
    written = []
    bar = None  # (made once the requests are in: a warning about them gets a line of its own)
    tokens, skipped, asked = 0, 0, 0
    try:
        for i in todo:
            waiting[i] = []
            for cid, messages in conversations[i * shard_size : (i + 1) * shard_size]:
                asked += 1
                first = next((m for m in messages if m["role"] == "user"), None)
                if first is None:  # (a chat of only a system turn)
                    skipped += 1
                    continue
                p = llm._chat_ids([first])
                # too long, or no room for an answer in the model's context: skipped (its id
                # stays in the shard's slice, so a resumed run skips it too)
                if len(p) > max_prompt_tokens or len(p) >= engine.max_model_len:
                    skipped += 1
                    continue
                params = SamplingParams(
                    temperature=temperature, max_tokens=max_tokens, seed=_seed(cid)
                )
                waiting[i].append((cid, p, engine.add_request(p, params, request_id=cid)))
        if skipped:  # (a user who asked for N conversations should know why fewer came)
            log.warning(
                "%d of %d conversations skipped: no user turn, or a first turn over "
                "--max-prompt-tokens (%d) or the model's context",
                skipped,
                asked,
                max_prompt_tokens,
            )
        bar = tqdm(total=len(todo), desc=f"generating (rank {rank}/{world})", unit="shard")
        while waiting:
            for seq in engine.step():
                tokens += len(seq.output_token_ids) if seq.finished else 0
            for i in [i for i, items in waiting.items() if all(s.finished for _, _, s in items)]:
                examples, feats = [], []
                for cid, p, seq in waiting.pop(i):
                    answer = list(seq.output_token_ids)
                    examples.append(Example(cid, p + answer, [0] * len(p) + [1] * len(answer)))
                    if recorder is not None:
                        f = recorder.pop(seq.seq_id)
                        feats.append(f[: len(p) + len(answer) - 1])
                shard_meta = {**meta, "slice_ids": json.dumps(ids_of(i))}
                write_shard(shard_path(out, i), examples, shard_meta, feats if recorder else None)
                written.append(shard_path(out, i))
                bar.update(1)
                bar.set_postfix(answer_tokens=tokens)
    finally:
        if bar is not None:
            bar.close()
        if recorder is not None:
            engine.feature_observers.remove(recorder)
            engine.runner.feature_layers = drafter_layers
        engine.manager.prefix_caching = caching
    # (0 written reads as nothing done: it says how many were there already)
    who, of = (f"rank {rank} of {world}: ", f"its {len(mine)}") if world > 1 else ("", num_shards)
    there = f"; {len(mine) - len(written)} already there" if len(written) < len(mine) else ""
    print(f"{who}wrote {len(written)} of {of} shards to {out}{there}", flush=True)
    return written
