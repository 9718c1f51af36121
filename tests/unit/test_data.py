"""Offline datasets: the truncated ShareGPT file, the split, HumanEval, evals."""

from __future__ import annotations

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
    assert len(train) > 15000 and 500 < len(held) < 1500
    assert all(data.split_of(c) == "held-out" for c in held)


def test_humaneval_and_evals():
    assert len(data.humaneval()) == 164
    rows = data.evals_samples("sql/spider_sql.jsonl")
    assert rows and "input" in rows[0]
