"""Offline datasets: the truncated ShareGPT file, the split, HumanEval, evals."""

from __future__ import annotations

import itertools
import json

from specdecode import data


def test_truncated_json_array_yields_complete_objects(tmp_path):
    objs = [
        {"id": str(i), "conversations": [{"from": "human", "value": "x" * i}]} for i in range(50)
    ]
    text = json.dumps(objs)
    path = tmp_path / "cut.json"
    path.write_text(text[: len(text) - 30])  # cut inside the last object
    got = list(data._iter_json_array(path, chunk=64))
    assert got == objs[:-1]


def test_turn_cleaning():
    turns = [
        {"from": "gpt", "value": "tail of an earlier split"},
        {"from": "human", "value": "hi"},
        {"from": "gpt", "value": "hello"},
        {"from": "human", "value": ""},
        {"from": "gpt", "value": "lost"},
    ]
    assert data._clean_turns(turns) == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
    ]


def test_sharegpt_split_is_disjoint_and_stable():
    train = {cid for cid, _ in data.sharegpt("train")}
    held = {cid for cid, _ in data.sharegpt("held-out")}
    assert not train & held
    assert len(train) > 15000 and 300 < len(held) < 1500
    assert all(data.split_of(c) == "held-out" for c in held)
    # nor a part of a chat another part of which is trained on (they often open alike)
    assert not {data.chat_of(c) for c in train} & {data.chat_of(c) for c in held}


def test_humaneval_and_evals():
    assert len(data.humaneval()) == 164
    rows = data.evals_samples("sql/spider_sql.jsonl")
    assert rows and "input" in rows[0]


def test_code_requests_are_told_from_chat():
    for text in (
        "Write a Python function that reverses a list",
        "why does this fail?\n```\nx = [1, 2\n```",
        "How do I join two tables in SQL?",
        "def f(x): return x  -- what does this do",
        "make a bash script that renames files",
    ):
        assert data.is_code_request(text), text
    for text in (
        "Write a poem about the sea",
        "What is the capital of France?",
        "Summarize the plot of Hamlet in three sentences",
        "Give me a recipe for pancakes",  # 'recipe' is not 'script'
        "Describe Javanese cuisine",  # no word 'java'
    ):
        assert not data.is_code_request(text), text


def test_sharegpt_code_is_a_subset_of_train_with_code_first_turns():
    code = list(itertools.islice(data.sharegpt_code("train"), 200))
    train = {cid for cid, _ in itertools.islice(data.sharegpt("train"), 2000)}
    assert len(code) == 200
    assert all(cid in train for cid, _ in code[:50])  # same order, filtered
    assert all(data.is_code_request(m[0]["content"]) for _, m in code if m[0]["role"] == "user")
    assert all(data.split_of(cid) == "train" for cid, _ in code)
