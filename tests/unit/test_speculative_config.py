"""`--speculative-config` keys: wrong types and keys that would do nothing for the method are
clear errors, not tracebacks or silent drops (each case from a review that tried them)."""

from __future__ import annotations

import pytest

from specdecode.config import SpeculativeConfig
from specdecode.errors import InvalidRequestError


@pytest.mark.parametrize(
    "raw, message",
    [
        # types
        ({"method": "ngram", "prompt_lookup_min": "2"}, "prompt_lookup_min must be a positive"),
        ({"method": "ngram", "prompt_lookup_min": 2.5}, "prompt_lookup_min must be a positive"),
        ({"method": "eagle", "model": 123}, "model must be a path or a name"),
        ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens must be"),
        ({"method": "eagle", "topk": True}, "topk must be a positive integer"),
        ({"method": "ngram", "disable_by_batch_size": True}, "disable_by_batch_size must be"),
        ({"method": "draft_model", "speculative_token_tree": "[[0.0], [1.0]]"}, "child ranks"),
        ({"method": "draft_model", "speculative_token_tree": "[]"}, "non-empty list"),
        ({"method": "medusa", "speculative_token_tree": [[0], [0, 0], [0]]}, "a choice twice"),
        ({"method": "medusa", "speculative_token_tree": [["a"]]}, "child ranks"),
        # keys that would do nothing for the method
        ({"method": "eagle", "speculative_token_tree": [[0], [1]]}, "EAGLE's trees are dynamic"),
        ({"method": "ngram", "speculative_token_tree": [[0]]}, "not to method ngram"),
        ({"method": "ngram", "draft_dtype": "int8"}, "method ngram has none"),
        ({"method": "ngram", "suffix_decoding_max_tree_depth": -5}, "method suffix"),
        ({"method": "eagle", "suffix_decoding_min_token_prob": 5}, "method suffix"),
        ({"method": "suffix", "prompt_lookup_max": 4}, "prompt_lookup_max applies to method ngram"),
        ({"method": "eagle", "prompt_lookup_min": 1}, "not to method eagle"),
        (
            {"method": "eagle3", "topk": 1, "num_draft_tokens": 20, "num_speculative_tokens": 3},
            "cannot be reached",
        ),
    ],
)
def test_bad_speculative_configs_are_clear_errors(raw, message):
    with pytest.raises(InvalidRequestError, match=message):
        SpeculativeConfig.from_dict(raw)


def test_what_applies_is_still_accepted():
    for raw in (
        {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3},
        {"method": "eagle", "prompt_lookup_tokens": 8, "prompt_lookup_min": 1},
        {"method": "eagle3", "prompt_lookup_tokens": 8, "prompt_lookup_method": "suffix",
         "suffix_decoding_max_tree_depth": 16},
        {"method": "suffix", "suffix_decoding_min_token_prob": 0.2},
        {"method": "medusa", "speculative_token_tree": "[[0], [1], [0, 0]]"},
        {"method": "medusa", "speculative_token_tree": [(0,), (1,), (0, 0)]},  # (vLLM's tuples)
        {"method": "eagle3", "topk": 1, "num_draft_tokens": 3, "num_speculative_tokens": 3},
    ):  # fmt: skip
        SpeculativeConfig.from_dict(raw)
    # the command line's JSON string, given to the Python API, reads as its dict
    assert SpeculativeConfig.from_dict('{"method": "ngram"}').method == "ngram"
    with pytest.raises(InvalidRequestError, match="must be a dict"):
        SpeculativeConfig.from_dict(["ngram"])


def test_the_error_is_importable_from_the_package():
    import specdecode

    assert specdecode.InvalidRequestError is InvalidRequestError
