"""argparse types for the command line: numbers in range and output paths, checked while the
flags are parsed, so a bad value is a one-line usage error before anything loads or runs (a
measurement that could not write its results would be lost)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path


def integer(low: int, high: int | None = None):
    """An integer in [low, high]."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        if high is not None and value > high:
            raise argparse.ArgumentTypeError(f"must be at most {high}, got {value}")
        return value

    return parse


at_least = integer  # (the name the bench commands use)


def number(
    low: float | None = None,
    high: float | None = None,
    *,
    above: float | None = None,
    below: float | None = None,
):
    """A finite float >= `low`, <= `high`, > `above`, < `below` (each where given)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if value != value or value in (float("inf"), float("-inf")):
            raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
        if low is not None and value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low:g}, got {value:g}")
        if high is not None and value > high:
            raise argparse.ArgumentTypeError(f"must be at most {high:g}, got {value:g}")
        if above is not None and value <= above:
            raise argparse.ArgumentTypeError(f"must be above {above:g}, got {value:g}")
        if below is not None and value >= below:
            raise argparse.ArgumentTypeError(f"must be below {below:g}, got {value:g}")
        return value

    return parse


# The temperatures accepted everywhere: every command's flags and the server's requests (vLLM
# sets no upper bound; 100 is far past where a distribution is flat, and catches typos).
MAX_TEMPERATURE = 100.0


def temperature(text: str) -> float:
    """A sampling temperature in [0, MAX_TEMPERATURE] (0: greedy)."""
    return number(0, MAX_TEMPERATURE)(text)


def temperature_list(text: str) -> str:
    """A comma list of at least one temperature (kept as text: "0, 0.7," reads as "0.0,0.7")."""
    values = [temperature(t) for t in text.split(",") if t.strip()]
    if not values:
        raise argparse.ArgumentTypeError(f"a comma list of temperatures, got {text!r}")
    return ",".join(map(str, values))


def output_file(text: str) -> str:
    """A file to write results to, in a folder that exists and can be written, and not itself
    a folder."""
    path = Path(text).expanduser()
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a folder; name a file in it")
    folder = path.resolve().parent
    if folder.exists() and not folder.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r}: {str(folder)!r} is a file, not a folder")
    if not folder.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r}: its folder does not exist")
    if not _writable(folder) or (path.exists() and not os.access(path, os.W_OK)):
        raise argparse.ArgumentTypeError(f"{text!r} cannot be written here")
    return text


def _writable(folder: Path) -> bool:
    """Whether a file can be made in `folder`: tried, not asked (os.access says yes to root
    on read-only mounts and /proc)."""
    import tempfile

    try:
        with tempfile.TemporaryFile(dir=folder):
            return True
    except OSError:
        return False


def output_dir(text: str) -> str:
    """A folder to write into (made if missing): not an existing file, and one that can be
    made and written (its nearest existing folder is a folder this user can write to)."""
    path = Path(text).expanduser()
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a file, not a folder")
    there = path.resolve()
    while not there.exists():
        there = there.parent
    if not there.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r}: {str(there)!r} is a file, not a folder")
    if not _writable(there):
        raise argparse.ArgumentTypeError(f"{text!r} cannot be written here")
    return text


def name_list(choices, what: str):
    """A comma list of at least one of `choices` (spaces dropped: "code, sql" reads as
    "code,sql"; kept as text); `what`: the kind of name, for the error."""

    def parse(text: str) -> str:
        names = [n.strip() for n in text.split(",") if n.strip()]
        unknown = [n for n in names if n not in choices]
        if not names or unknown:
            raise argparse.ArgumentTypeError(
                f"unknown {what} {unknown[0]!r}; choose from {', '.join(choices)}"
                if unknown
                else f"names no {what}"
            )
        return ",".join(names)

    return parse
