"""Token maps (SGLang's --speculative-token-map, FR-Spec): the formats read, what is refused and
why, and the methods they apply to."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from specdecode.config import SpeculativeConfig
from specdecode.errors import InvalidRequestError
from specdecode.models.token_map import load_token_map, save_token_map


@pytest.mark.parametrize("suffix", [".json", ".safetensors"])
def test_a_written_map_reads_back_sorted_distinct_with_the_end_ids(tmp_path, suffix):
    path = tmp_path / f"map{suffix}"
    save_token_map(torch.tensor([7, 3, 3, 40]), path)
    assert load_token_map(path, 50).tolist() == [3, 7, 40]
    assert load_token_map(path, 50, always=(2, 40)).tolist() == [2, 3, 7, 40]
    # an end id past the model's vocabulary (a tokenizer's added token) is not the model's
    assert load_token_map(path, 50, always=(2, 60)).tolist() == [2, 3, 7, 40]


def test_sglangs_pickled_maps_need_allow_pickle(tmp_path):
    """FR-Spec publishes its maps as torch.save'd tensors (freq_32768.pt): pickle, so refused by
    default as every pickle checkpoint is, and read with the weights-only loader when allowed."""
    path = tmp_path / "freq_4.pt"
    torch.save(torch.tensor([5, 1, 9, 2]), path)
    with pytest.raises(InvalidRequestError, match="--allow-pickle"):
        load_token_map(path, 10)
    assert load_token_map(path, 10, allow_pickle=True).tolist() == [1, 2, 5, 9]
    torch.save([4, 8], tmp_path / "list.pt")  # a plain list, as some scripts save them
    assert load_token_map(tmp_path / "list.pt", 10, allow_pickle=True).tolist() == [4, 8]


@pytest.mark.parametrize(
    "content,message",
    [
        ([1, 2, 99], "outside the target's vocabulary"),
        ([1, -1, 3], "outside the target's vocabulary"),
        ([1.5, 2.0], "1-D list of integer token ids"),
        ([[1, 2], [3, 4]], "1-D"),
        ([True, False], "1-D list of integer token ids"),
        ([3], "need >= 2"),
        ([], "keeps no token"),
        ({"a": [1], "b": [2]}, "not a list of token ids"),
        ("7", "not a list of token ids"),
    ],
)
def test_a_map_that_is_not_one_is_a_clear_error(tmp_path, content, message):
    path = tmp_path / "map.json"
    path.write_text(json.dumps(content))
    with pytest.raises(InvalidRequestError, match=message):
        load_token_map(path, 50)


def test_unreadable_files_are_clear_errors(tmp_path):
    with pytest.raises(InvalidRequestError, match="does not exist"):
        load_token_map(tmp_path / "none.json", 50)
    with pytest.raises(InvalidRequestError, match="is a directory"):
        load_token_map(tmp_path, 50)
    (tmp_path / "map.txt").write_text("1 2 3")
    with pytest.raises(InvalidRequestError, match="unknown format"):
        load_token_map(tmp_path / "map.txt", 50)
    (tmp_path / "bad.json").write_text("[1, 2")
    with pytest.raises(InvalidRequestError, match="cannot be read"):
        load_token_map(tmp_path / "bad.json", 50)
    (tmp_path / "bad.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(InvalidRequestError, match="cannot be read"):
        load_token_map(tmp_path / "bad.safetensors", 50)
    save_file({"a": torch.tensor([1, 2]), "b": torch.tensor([3])}, tmp_path / "two.safetensors")
    with pytest.raises(InvalidRequestError, match="2 tensors"):
        load_token_map(tmp_path / "two.safetensors", 50)
    with pytest.raises(InvalidRequestError, match=r"\.safetensors or \.json"):
        save_token_map(torch.tensor([1, 2]), tmp_path / "map.pt")


@pytest.mark.parametrize("method", ["eagle", "medusa", "draft_model"])
def test_the_methods_with_an_lm_head_take_a_map(method):
    assert SpeculativeConfig.from_dict({"method": method, "token_map": "m.json"}).token_map


@pytest.mark.parametrize(
    "config,message",
    [
        ({"method": "eagle3"}, "own draft vocabulary"),
        ({"method": "ngram"}, "no LM head"),
        ({"method": "suffix"}, "no LM head"),
        ({"method": "draft_model", "draft_vocab_size": 100}, "give one"),
        ({"method": "eagle", "token_map": 5}, "must be a string"),
    ],
)
def test_a_map_where_it_does_nothing_is_refused(config, message):
    with pytest.raises(InvalidRequestError, match=message):
        SpeculativeConfig.from_dict({"token_map": "m.json", **config})


def test_a_benchmark_row_names_its_map():
    """Configs that differ by their map alone are told apart in `bench latency`'s rows."""
    from specdecode.bench.speculative import _label

    with_map = SpeculativeConfig.from_dict({"method": "eagle", "token_map": "maps/smol-8k.json"})
    plain = SpeculativeConfig.from_dict({"method": "eagle"})
    assert _label(with_map) == _label(plain) + " map smol-8k.json"
