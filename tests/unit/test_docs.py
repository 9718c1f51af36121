"""The commands the README and docs/ show are ones the CLI accepts: every `specdecode ...` line
of a fenced shell block, and every inline one that passes a flag, parses, and its speculative
flags merge into a valid speculative config."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from specdecode.cli import build_parser, speculative_config
from specdecode.config import SpeculativeConfig

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def documented_commands(text: str) -> list[str]:
    found = []
    for lang, block in re.findall(r"```(\w*)\n(.*?)```", text, re.S):
        if lang not in ("", "bash", "sh", "shell", "console"):
            continue
        for line in _joined(block.replace("\\\n", " ").splitlines()):
            line = line.strip().removeprefix("$ ")
            line = re.sub(r"^torchrun .*?-m specdecode\.cli ", "specdecode ", line)
            if line.startswith("specdecode "):
                found.append(line)
    for inline in re.findall(r"`(specdecode [^`]+)`", text.replace("\n", " ")):
        if " --" in inline:
            found.append(inline)
    # A comment or a second command on the line is not part of this one; a quoted "..." is a
    # placeholder value (a prompt), where "[...]" marks a value elided in prose.
    cut = [re.split(r"\s+#\s|\s+(?:\||&&|;)\s", c)[0] for c in found]
    cut = [c.replace('"..."', '"x"') for c in cut]
    return [c for c in cut if "..." not in c]


def _joined(lines: list[str]) -> list[str]:
    """Shell lines, a quoted value that spans lines (a JSON config) joined into its command."""
    out: list[str] = []
    open_quote = False
    for line in lines:
        if open_quote:
            out[-1] += " " + line.strip()
        else:
            out.append(line)
        try:
            shlex.split(out[-1].split(" #")[0] if not open_quote else out[-1])
            open_quote = False
        except ValueError:
            open_quote = True
    return out


def orphan_flag_lines(text: str) -> list[str]:
    """Lines of a shell block that start with a flag where the line before does not continue
    (a command cut in two: copied, it fails)."""
    bad = []
    for lang, block in re.findall(r"```(\w*)\n(.*?)```", text, re.S):
        if lang not in ("", "bash", "sh", "shell", "console"):
            continue
        lines = block.splitlines()
        for before, line in zip(["", *lines], lines, strict=False):
            if line.lstrip().startswith("--") and not before.rstrip().endswith("\\"):
                bad.append(line.strip())
    return bad


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_no_command_is_cut_in_two(doc):
    assert orphan_flag_lines(doc.read_text()) == []
    assert orphan_flag_lines("```bash\n# a note\n    --port 1\n```") == ["--port 1"]


def test_the_docs_show_commands():
    assert len([c for d in DOCS for c in documented_commands(d.read_text())]) >= 40


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_documented_commands_parse(doc):
    parser = build_parser()
    bad = []
    for command in documented_commands(doc.read_text()):
        try:
            args = parser.parse_args(shlex.split(command)[1:])
            spec = speculative_config(args)
            if spec:
                SpeculativeConfig.from_dict(spec)
        except SystemExit as e:  # argparse: usage error
            if e.code:
                bad.append(command)
        except Exception as e:  # noqa: BLE001 - every kind of refusal is a documentation bug
            bad.append(f"{command}\n    -> {type(e).__name__}: {e}")
    assert not bad, "documented commands the CLI refuses:\n" + "\n".join(bad)


def test_a_wrong_flag_would_be_caught():
    parser = build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(shlex.split("generate --prompt hi --max-tokenz 3"))
    assert documented_commands("```bash\nspecdecode serve --port 1  # a note\n```") == [
        "specdecode serve --port 1"
    ]
