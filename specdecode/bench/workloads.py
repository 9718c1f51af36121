"""Benchmark workloads from the offline datasets, as chat message lists."""

from __future__ import annotations

from specdecode import data
from specdecode.errors import InvalidRequestError

Messages = list[dict[str, str]]

WORKLOADS = ("code", "sql", "json", "writing", "chat")


def load(name: str, n: int) -> list[Messages]:
    """The first `n` prompts of a workload (deterministic)."""
    if name == "code":
        return [
            [
                {
                    "role": "user",
                    "content": "Complete this Python function. Reply with the whole "
                    f"function in one code block.\n\n```python\n{p['prompt']}```",
                }
            ]
            for p in data.humaneval()[:n]
        ]
    if name == "sql":
        return [_system_as_user(r["input"]) for r in data.evals_samples("sql/spider_sql.jsonl")[:n]]
    if name == "json":
        rows = data.evals_samples("json_patch_object/samples.jsonl")[:n]
        return [_system_as_user(r["input"]) for r in rows]
    if name == "writing":
        return [[{"role": "user", "content": q}] for q in data.writingbench(n)]
    if name == "chat":
        out = []
        for _, messages in data.sharegpt("held-out"):
            first = messages[0] if messages[0]["role"] == "user" else messages[1]
            if len(first["content"]) < 2000:
                out.append([first])
            if len(out) == n:
                break
        return out
    raise InvalidRequestError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")


def _system_as_user(messages: Messages) -> Messages:
    """evals rows often carry the task in a system turn; small chat models follow it better as
    the user's request."""
    text = "\n\n".join(m["content"] for m in messages)
    return [{"role": "user", "content": text}]
