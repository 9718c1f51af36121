"""Model names: a built-in or pullable model's Hugging Face id (what /v1/models advertises and
what commands and clients written for vLLM name) resolves to that model, and the server
answers to it."""

from __future__ import annotations

from argparse import Namespace
from pathlib import Path

import pytest

from specdecode.errors import InvalidRequestError, ModelNotFoundError
from specdecode.models import loader
from specdecode.models.loader import DEFAULT_HUB_ID, DEFAULT_MODEL, hub_id, resolve_model
from specdecode.serving.server import serve_model, served_names


@pytest.fixture
def no_conversion(monkeypatch, tmp_path):
    """The default model found and 'converted' without reading its 100 MB."""
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(loader, "default_gguf_path", lambda: tmp_path / "default.gguf")
    monkeypatch.setattr(loader, "convert_gguf_cached", lambda path, name=None: Path("/c") / name)


def test_the_default_models_hub_id_is_the_default_model(no_conversion, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    default = resolve_model(None)
    for name in (DEFAULT_HUB_ID, DEFAULT_HUB_ID.lower(), DEFAULT_HUB_ID.upper()):
        assert resolve_model(name) == default == Path("/c") / DEFAULT_MODEL
    with pytest.raises(ModelNotFoundError, match="model not found"):
        resolve_model("HuggingFaceTB/SmolLM2-360M-Instruct")
    # a local path of that name is what it names, as in vLLM
    (tmp_path / DEFAULT_HUB_ID).mkdir(parents=True)
    with pytest.raises(ModelNotFoundError, match="has no config.json"):
        resolve_model(DEFAULT_HUB_ID)


def test_a_pullable_models_hub_id_is_that_model(no_conversion):
    with pytest.raises(ModelNotFoundError, match="models pull qwen2.5-coder-0.5b"):
        resolve_model("qwen/qwen2.5-coder-0.5b-instruct")
    assert hub_id("qwen2.5-coder-1.5b") == "Qwen/Qwen2.5-Coder-1.5B-Instruct"
    assert hub_id("QWEN/Qwen2.5-Coder-1.5B-Instruct") == "Qwen/Qwen2.5-Coder-1.5B-Instruct"
    for name in (None, "default", DEFAULT_MODEL, DEFAULT_HUB_ID.lower()):
        assert hub_id(name) == DEFAULT_HUB_ID
    assert hub_id("some/dir") is None


def test_served_names():
    assert served_names(None, None) == (DEFAULT_HUB_ID, ())
    assert served_names("default", None) == ("default", (DEFAULT_HUB_ID,))
    assert served_names(DEFAULT_HUB_ID, None) == (DEFAULT_HUB_ID, ())
    assert served_names("qwen2.5-coder-1.5b", None) == (
        "qwen2.5-coder-1.5b", ("Qwen/Qwen2.5-Coder-1.5B-Instruct",)
    )  # fmt: skip
    assert served_names("/models/x", None) == ("/models/x", ())
    assert served_names("qwen2.5-coder-1.5b", "coder") == ("coder", ())  # alone, as in vLLM
    assert served_names("m", ["coder"]) == ("coder", ())
    assert served_names("m", ["a", "b", "c"]) == ("a", ("b", "c"))  # (vLLM's several names)


def test_serve_takes_the_model_as_vllm_does_or_by_flag():
    """`specdecode serve MODEL` (the parser's `model_tag`) or `--model`, not two different ones."""
    assert serve_model(Namespace(model_tag=DEFAULT_HUB_ID, model=None)) == DEFAULT_HUB_ID
    assert serve_model(Namespace(model_tag=None, model="m")) == "m"
    assert serve_model(Namespace(model="m")) == "m"  # a parser without the positional
    assert serve_model(Namespace(model_tag="m", model="m")) == "m"
    with pytest.raises(InvalidRequestError, match="two models"):
        serve_model(Namespace(model_tag="a", model="b"))
