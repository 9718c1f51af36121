"""Self-distillation data: the target regenerates the assistant turns of training chats.

Heads and draft models learn the target's own distribution (training on someone else's answers,
or without the target's chat template, is a known cause of low acceptance). For each ShareGPT
*train* conversation the first user turn is wrapped in the target's chat template and the target
answers it; the shard stores the token ids of prompt + answer and a loss mask that is 1 on the
answer's tokens only.

Shards (`shard-00000.safetensors`, ...) hold a fixed range of conversations, are written
atomically and skipped when present, so an interrupted run resumes where it stopped. Under
`torchrun` each rank takes the shards with index % WORLD_SIZE == RANK.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)


@dataclass
class Example:
    conversation_id: str
    input_ids: list[int]  # prompt + answer
    loss_mask: list[int]  # 1 on the answer's tokens (what the target generated)


def shard_path(out: Path, index: int) -> Path:
    return out / f"shard-{index:05d}.safetensors"


def write_shard(path: Path, examples: list[Example], metadata: dict) -> None:
    from safetensors.torch import save_file

    offsets = [0]
    for ex in examples:
        offsets.append(offsets[-1] + len(ex.input_ids))
    tensors = {
        "input_ids": torch.tensor([t for ex in examples for t in ex.input_ids], dtype=torch.int32),
        "loss_mask": torch.tensor([m for ex in examples for m in ex.loss_mask], dtype=torch.uint8),
        "offsets": torch.tensor(offsets, dtype=torch.int64),
    }
    meta = {**metadata, "conversation_ids": json.dumps([ex.conversation_id for ex in examples])}
    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp), metadata={k: str(v) for k, v in meta.items()})
    os.replace(tmp, path)


def read_shard(path: Path) -> list[Example]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        ids, mask, offsets = (f.get_tensor(k) for k in ("input_ids", "loss_mask", "offsets"))
        conv_ids = json.loads(f.metadata()["conversation_ids"])
    out = []
    for i, cid in enumerate(conv_ids):
        a, b = int(offsets[i]), int(offsets[i + 1])
        out.append(Example(cid, ids[a:b].tolist(), mask[a:b].tolist()))
    return out


def iter_examples(data_dir: Path) -> Iterator[Example]:
    for path in sorted(data_dir.glob("shard-*.safetensors")):
        yield from read_shard(path)


def _seed(conversation_id: str) -> int:
    """A per-conversation seed that is the same in every process (unlike `hash`)."""
    return int(hashlib.sha256(conversation_id.encode()).hexdigest()[:8], 16)


def rank_and_world() -> tuple[int, int]:
    """torchrun sets RANK and WORLD_SIZE; a plain run is rank 0 of 1."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def generate(
    llm,
    conversations: list[tuple[str, list[dict]]],
    out: Path,
    shard_size: int = 64,
    max_tokens: int = 256,
    temperature: float = 0.0,
    max_prompt_tokens: int = 512,
) -> list[Path]:
    """Answer each conversation's first user turn with the target; write this rank's shards."""
    from tqdm import tqdm

    from specdecode.sampling import SamplingParams

    out.mkdir(parents=True, exist_ok=True)
    rank, world = rank_and_world()
    num_shards = -(-len(conversations) // shard_size)
    mine = [i for i in range(num_shards) if i % world == rank]
    todo = [i for i in mine if not shard_path(out, i).exists()]
    if len(todo) < len(mine):
        log.info("resuming: %d of %d shards already written", len(mine) - len(todo), len(mine))
    meta = {
        "model": str(llm.engine.model_path.name),
        "max_tokens": max_tokens,
        "temperature": temperature,
        "source": "sharegpt train split, first user turn",
    }
    written = []
    for i in tqdm(todo, desc=f"generating (rank {rank}/{world})", unit="shard"):
        chunk = conversations[i * shard_size : (i + 1) * shard_size]
        prompts, ids = [], []
        for cid, messages in chunk:
            p = llm._chat_ids([messages[0]])
            if len(p) <= max_prompt_tokens:
                prompts.append(p)
                ids.append(cid)
        params = [
            SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=hash(c) % 2**31)
            for c in ids
        ]
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        examples = [
            Example(
                cid, p + o.outputs[0].token_ids, [0] * len(p) + [1] * len(o.outputs[0].token_ids)
            )
            for cid, p, o in zip(ids, prompts, outputs, strict=True)
        ]
        write_shard(shard_path(out, i), examples, meta)
        written.append(shard_path(out, i))
    return written
