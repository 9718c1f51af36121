"""Draft vocabularies given as a file: SGLang's `--speculative-token-map` (FR-Spec, Zhao et al.
2025, "FR-Spec: Accelerating Large-Vocabulary Language Models via Frequency-Ranked Speculative
Sampling"). The drafter's LM head keeps only these target token ids, so a draft step scores a
fraction of a large vocabulary; the target still verifies over the whole one, so the output is
unchanged (a token outside the map is never drafted, only ever sampled by the target).

A map is a 1-D list of target token ids, in any order:
- `.json`: a JSON list of integers;
- `.safetensors`: one 1-D integer tensor (what `specdecode data token-map` writes);
- `.pt` / `.pth` / `.bin`: a pickled tensor or list, as SGLang and FR-Spec publish them (e.g.
  `freq_32768.pt`). Pickle can run code when loaded: refused unless --allow-pickle (it is then
  loaded with torch's weights-only loader).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from specdecode.errors import InvalidRequestError

PICKLE_SUFFIXES = (".pt", ".pth", ".bin")
SUFFIXES = (".json", ".safetensors", *PICKLE_SUFFIXES)
SAFETENSORS_KEY = "token_ids"


def _read(path: Path, allow_pickle: bool):
    suffix = path.suffix.lower()
    if suffix == ".json":
        return json.loads(path.read_text(encoding="utf-8"))
    if suffix == ".safetensors":
        from safetensors.torch import load_file

        tensors = load_file(str(path))
        if len(tensors) != 1:
            raise ValueError(f"it holds {len(tensors)} tensors ({', '.join(tensors)}), not one")
        return next(iter(tensors.values()))
    if not allow_pickle:
        raise InvalidRequestError(
            f"token map {path} is a pickle file ({suffix}), which can run code when loaded: it "
            "is refused unless you pass --allow-pickle (allow_pickle=True); .json and "
            ".safetensors maps need no such trust"
        )
    return torch.load(str(path), map_location="cpu", weights_only=True)


def load_token_map(
    path: str | Path, vocab_size: int, allow_pickle: bool = False, always: tuple[int, ...] = ()
) -> torch.Tensor:
    """The sorted, distinct target ids of the map at `path` (int64), with `always` (the end of
    sequence ids: a drafter that cannot propose the end stops every finished answer one step
    late) added; a clear error for a file that is not a map of this vocabulary."""
    path = Path(path).expanduser()
    if not path.is_file():
        what = "is a directory" if path.is_dir() else "does not exist"
        raise InvalidRequestError(f"token map {path} {what}")
    if path.suffix.lower() not in SUFFIXES:
        raise InvalidRequestError(
            f"token map {path}: unknown format {path.suffix!r}; use one of {', '.join(SUFFIXES)}"
        )
    try:
        raw = _read(path, allow_pickle)
    except InvalidRequestError:
        raise
    except Exception as e:  # (a damaged or foreign file: json, safetensors, torch errors)
        raise InvalidRequestError(f"token map {path} cannot be read: {e}") from e
    if isinstance(raw, dict) and len(raw) == 1:  # ({"token_ids": [...]} or a state dict)
        raw = next(iter(raw.values()))
    if isinstance(raw, list) and not raw:
        raise InvalidRequestError(f"token map {path}: it keeps no token; need >= 2")
    if isinstance(raw, list) and not all(isinstance(t, int) and not isinstance(t, bool)
                                         for t in raw):  # fmt: skip
        raise InvalidRequestError(f"token map {path}: a 1-D list of integer token ids is needed")
    try:
        ids = torch.as_tensor(raw)
    except Exception as e:
        raise InvalidRequestError(f"token map {path}: not a list of token ids ({e})") from e
    if ids.dim() != 1 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise InvalidRequestError(
            f"token map {path}: a 1-D list of integer token ids is needed, got a "
            f"{ids.dim()}-D tensor of {ids.dtype}"
        )
    ids = ids.long()
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise InvalidRequestError(
            f"token map {path}: ids {int(ids.min())}..{int(ids.max())} are outside the target's "
            f"vocabulary (0..{vocab_size - 1}): it was made for another tokenizer"
        )
    ends = [t for t in always if 0 <= t < vocab_size]  # (a tokenizer's id past the model's)
    ids = torch.unique(torch.cat([ids, torch.tensor(ends, dtype=torch.long)]))
    if ids.numel() < 2:
        raise InvalidRequestError(f"token map {path}: it keeps {ids.numel()} token; need >= 2")
    return ids


def save_token_map(ids: torch.Tensor, path: str | Path) -> None:
    """Write a map as `.safetensors` (one int64 tensor) or `.json` (a list)."""
    path = Path(path).expanduser()
    ids = ids.detach().cpu().long().contiguous()
    if path.suffix.lower() == ".json":
        path.write_text(json.dumps(ids.tolist()) + "\n", encoding="utf-8")
    elif path.suffix.lower() == ".safetensors":
        from specdecode.models.loader import write_safetensors

        write_safetensors({SAFETENSORS_KEY: ids}, path)  # (atomic, the umask's mode)
    else:
        raise InvalidRequestError(
            f"{path}: a token map is written as .safetensors or .json (pickle is not written)"
        )
