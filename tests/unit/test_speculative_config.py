"""`--speculative-config` keys: wrong types and keys that would do nothing for the method are
clear errors, not tracebacks or silent drops (each case from a review that tried them)."""

from __future__ import annotations

import pytest
import torch

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


def test_without_a_method_the_models_checkpoint_names_it(tmp_path):
    """vLLM infers the method from the model; here from what the checkpoint is: a head's kind,
    "[ngram]" (vLLM's legacy spelling), a head `models pull` builds, else a draft model."""
    from pathlib import Path

    import specdecode

    assets = Path(specdecode.__file__).parent / "assets"
    for kind in ("eagle", "eagle3", "medusa"):
        cfg = SpeculativeConfig.from_dict({"model": str(assets / f"smollm2-135m-{kind}")})
        assert cfg.method == kind
    ngram = SpeculativeConfig.from_dict({"model": "[ngram]", "num_speculative_tokens": 3})
    assert (ngram.method, ngram.model) == ("ngram", None)
    assert SpeculativeConfig.from_dict({"model": "qwen2.5-coder-1.5b-eagle3"}).method == "eagle3"
    assert SpeculativeConfig.from_dict({"model": str(tmp_path)}).method == "draft_model"
    # a one-layer model (a `train draft --num-layers 1` draft, or any): no EAGLE fc, a draft
    import json

    from safetensors.torch import save_file

    one = tmp_path / "one-layer"
    one.mkdir()
    (one / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"],
                                                 "num_hidden_layers": 1}))  # fmt: skip
    save_file({"model.layers.0.mlp.up_proj.weight": torch.zeros(2, 2)}, one / "m.safetensors")
    assert SpeculativeConfig.from_dict({"model": str(one)}).method == "draft_model"
    from specdecode.models.head_io import head_kind

    assert head_kind(one) is None  # (served as a head, it is refused as no head at all)
    save_file({"fc.weight": torch.zeros(2, 4)}, one / "m.safetensors")  # SafeAILab EAGLE-1's
    assert SpeculativeConfig.from_dict({"model": str(one)}).method == "eagle"
    (one / "config.json").write_text(json.dumps({"num_hidden_layers": 1, "specdecode_draft": {}}))
    assert SpeculativeConfig.from_dict({"model": str(one)}).method == "draft_model"
    with pytest.raises(InvalidRequestError, match="needs a 'method'"):
        SpeculativeConfig.from_dict({"num_speculative_tokens": 3})


def test_vllm_keys_with_nothing_to_set_are_accepted_at_what_this_engine_does():
    """A config copied from a vLLM command: its keys are accepted where their value is what
    happens here anyway, and refused with the reason where it asks for something else."""
    cfg = SpeculativeConfig.from_dict(
        {
            "method": "ngram",
            "draft_tensor_parallel_size": 1,
            "disable_logprobs": False,
            "disable_log_stats": False,
            "disable_padded_drafter_batch": True,
            "acceptance_method": "rejection_sampler",
            "revision": None,
        }  # fmt: skip
    )
    assert cfg.method == "ngram"
    for key, value, message in (
        ("draft_tensor_parallel_size", 2, "one device"),
        ("acceptance_method", "typical_acceptance_sampler", "lossless rejection sampler"),
        ("quantization", "fp8", "draft_dtype"),
        ("max_model_len", 512, "its own context"),
        ("revision", "v2", "local path"),
        ("disable_logprobs", "yes", "a boolean"),
    ):
        with pytest.raises(InvalidRequestError, match=f"{key}=.*{message}"):
            SpeculativeConfig.from_dict({"method": "ngram", key: value})
