"""Structured output: JSON schema, JSON object, regex and EBNF grammar constraints (xgrammar).

Semantics (exact): the constrained target distribution at each position is the target's,
masked to the tokens the grammar allows there and renormalised. With speculation, every draft
tree is pruned to the tokens the grammar allows along each path (the matcher is advanced along
the path and rolled back), and each node's p, and q for sampled drafts, is masked with the
grammar's mask at that node; verification is unchanged, so the output is distributed exactly
as constrained decoding without speculation (and is token-identical to it under greedy).

Jump-ahead: when the grammar allows exactly one token next, it is appended without asking the
model (it has probability 1 under the constraint, so this is lossless) and counted in
`Sequence.num_forced_tokens`; the forced tokens are fed to the model in the next step.

JSON is compiled without free whitespace (xgrammar's `any_whitespace=False`: the separators
", " and ": ", as Python's json.dumps writes them): the same JSON values, and a model cannot
wander into endless whitespace.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from specdecode.errors import InvalidRequestError

KINDS = ("json", "json_object", "regex", "grammar", "choice")


@dataclass(frozen=True)
class StructuredOutput:
    """Exactly one constraint (vLLM's structured-output fields): `json` (a JSON schema, as a dict
    or a string), `json_object` (any JSON object), `regex`, `grammar` (EBNF, GBNF style), or
    `choice` (one of the given strings)."""

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    grammar: str | None = None
    choice: list[str] | tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise InvalidRequestError(
                f"a structured output needs exactly one of {', '.join(KINDS)}; got "
                f"{', '.join(given) or 'none'}"
            )
        if isinstance(self.json, str):
            try:
                schema = json.loads(self.json)
            except json.JSONDecodeError as e:
                raise InvalidRequestError(f"the JSON schema is not valid JSON: {e}") from e
            object.__setattr__(self, "json", schema)
        if self.json is not None and not isinstance(self.json, (dict, bool)):
            raise InvalidRequestError("a JSON schema must be an object")
        for k in ("regex", "grammar"):
            v = getattr(self, k)
            if v is not None and (not isinstance(v, str) or not v):
                raise InvalidRequestError(f"{k} must be a non-empty string")
        if self.choice is not None:
            c = self.choice
            if not isinstance(c, (list, tuple)) or not c:
                raise InvalidRequestError("choice must be a non-empty list of strings")
            if not all(isinstance(x, str) and x for x in c):
                raise InvalidRequestError("choice must hold non-empty strings")
            object.__setattr__(self, "choice", tuple(c))

    @classmethod
    def coerce(cls, value: Any) -> StructuredOutput | None:
        if value is None or isinstance(value, StructuredOutput):
            return value
        if isinstance(value, dict):
            unknown = set(value) - set(KINDS)
            if unknown:
                raise InvalidRequestError(
                    f"unknown structured output keys: {', '.join(sorted(unknown))}"
                )
            return cls(**value)
        raise InvalidRequestError("structured_output must be a dict or a StructuredOutput")

    @property
    def key(self) -> tuple[str, str]:
        if self.json is not None:
            # not sorted: the schema's property order is the order the keys are written in
            return "json", json.dumps(self.json)
        if self.json_object:
            return "json_object", ""
        if self.regex is not None:
            return "regex", self.regex
        if self.choice is not None:
            return "choice", json.dumps(self.choice)
        return "grammar", self.grammar or ""


class GrammarCompiler:
    """Compiles constraints for one tokenizer, with a bounded cache of compiled grammars.
    Thread-safe: requests are compiled on the HTTP side, matched on the engine side."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int], cache: int = 128):
        try:
            import xgrammar as xgr
        except ImportError as e:  # pragma: no cover - a dependency
            raise InvalidRequestError("structured output needs the xgrammar package") from e
        self.xgr = xgr
        self.vocab_size = vocab_size
        self.info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids
        )
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._limit = cache
        self._lock = threading.Lock()
        self._vocab: list[bytes] | None = None  # each token's bytes, read once when needed

    def compile(self, so: StructuredOutput):
        key = so.key
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        try:
            if so.json is not None:
                compiled = self.compiler.compile_json_schema(
                    json.dumps(so.json), any_whitespace=False, strict_mode=True
                )
            elif so.json_object:
                schema = {"type": "object"}
                compiled = self.compiler.compile_json_schema(
                    json.dumps(schema), any_whitespace=False
                )
            elif so.regex is not None:
                compiled = self.compiler.compile_regex(so.regex)
            elif so.choice is not None:  # EBNF string literals take JSON's escapes
                alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in so.choice)
                compiled = self.compiler.compile_grammar(f"root ::= {alternatives}")
            else:
                compiled = self.compiler.compile_grammar(so.grammar)
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError / its own errors
            raise InvalidRequestError(f"cannot compile the {key[0]} constraint: {e}") from e
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > self._limit:
                self._cache.popitem(last=False)
        return compiled

    def matcher(self, so: StructuredOutput, after: str | None = None):
        """A matcher for `so`; with `after`, one that lets the reply write anything until it
        has written that text (see ReasoningGate)."""
        matcher = self.xgr.GrammarMatcher(self.compile(so))
        if after is None:
            return matcher
        if self._vocab is None:
            self._vocab = list(self.info.decoded_vocab)
        return ReasoningGate(matcher, after.encode(), self._vocab)

    def new_bitmask(self, rows: int) -> torch.Tensor:
        return self.xgr.allocate_token_bitmask(rows, self.vocab_size)


class ReasoningGate:
    """A grammar matcher for a reply that reasons before it answers (vLLM's reasoning models:
    "<think> ... </think>", then the answer): every token is allowed, and the grammar left
    untouched, until the reply's bytes (each token's, as the vocabulary spells it, special
    tokens' text included) have written `end`; from the token after the one that completes it,
    the wrapped matcher constrains the reply. It answers the matcher calls the engine makes
    (accept, roll back, fill the mask, terminated), so drafting, pruning, verification and
    jump-ahead work on it unchanged; rolling back over the token that ended the reasoning
    opens the reasoning again. Text that a token carries after `end` (a token spelling
    "</think>\n") is the reply's, unconstrained: the grammar starts at a token boundary."""

    def __init__(self, matcher, end: bytes, vocab: list[bytes]) -> None:
        self.matcher, self.end, self.vocab = matcher, end, vocab
        # the matcher for `end` (Knuth-Morris-Pratt): fail[i], the longest proper border of
        # end[:i + 1]
        fail = [0] * len(end)
        k = 0
        for i in range(1, len(end)):
            while k and end[i] != end[k]:
                k = fail[k - 1]
            if end[i] == end[k]:
                k += 1
            fail[i] = k
        self._fail = fail
        self.matched = 0  # how much of `end` the reply's bytes end with
        self.reasoning = True
        # per accepted token: the bytes matched before it, while reasoning; None once the
        # grammar took it
        self._history: list[int | None] = []

    def accept_token(self, token: int) -> bool:
        if not self.reasoning:
            if not self.matcher.accept_token(token):
                return False
            self._history.append(None)
            return True
        before = k = self.matched
        end, fail = self.end, self._fail
        spelled = self.vocab[token] if 0 <= token < len(self.vocab) else b""
        for byte in spelled:
            while k and byte != end[k]:
                k = fail[k - 1]
            if byte == end[k]:
                k += 1
            if k == len(end):
                self.reasoning = False
                break
        self.matched = k
        self._history.append(before)
        return True

    def rollback(self, n: int) -> None:
        for _ in range(n):
            before = self._history.pop()
            if before is None:
                self.matcher.rollback(1)
            else:  # a token accepted while reasoning (perhaps the one that ended it)
                self.reasoning, self.matched = True, before

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, row: int = 0) -> None:
        if self.reasoning:
            bitmask[row].fill_(-1)  # every bit: every token
        else:
            self.matcher.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return not self.reasoning and self.matcher.is_terminated()


# A request whose grammar allows no token of the model's vocabulary next ends with this error.
DEAD_END = "the grammar cannot be continued with this model's vocabulary"


def bitmask_to_bool(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[n, ceil(V/32)] int32 (bit j of word w: token 32w + j allowed) -> [n, V] bool."""
    bits = torch.arange(32, dtype=torch.int32)
    allowed = (bitmask.unsqueeze(-1) >> bits) & 1  # [n, W, 32]
    return allowed.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def node_masks(matcher, compiler: GrammarCompiler, tokens: list[int], children: list[list[int]]):
    """Allowed next tokens at every node of a draft tree ([n, V] bool), walking the matcher along
    each path (accept, recurse, roll back). The root is the last decided token, already accepted
    by the matcher. A node whose token the grammar refuses gets an all-False row (it is pruned
    before verification, so its row is never used)."""
    n = len(tokens)
    bitmask = compiler.new_bitmask(n)
    bitmask.zero_()

    def visit(node: int) -> None:
        if matcher.is_terminated():  # the node is a stop token: nothing may follow
            return
        matcher.fill_next_token_bitmask(bitmask, node)
        for c in children[node]:
            if matcher.accept_token(tokens[c]):
                visit(c)
                matcher.rollback(1)

    visit(0)
    return bitmask_to_bool(bitmask, compiler.vocab_size)


def single_allowed(matcher, compiler: GrammarCompiler) -> tuple[int | None, torch.Tensor]:
    """The only token the grammar allows next, if exactly one is allowed (else None), and the
    [1, W] bitmask of what it allows (kept for the next step's mask)."""
    bitmask = compiler.new_bitmask(1)
    matcher.fill_next_token_bitmask(bitmask, 0)
    words = bitmask[0]
    nonzero = torch.nonzero(words).flatten()
    if nonzero.numel() != 1:
        return None, bitmask
    w = int(nonzero[0])
    word = int(words[w]) & 0xFFFFFFFF
    if word & (word - 1):  # more than one bit set
        return None, bitmask
    token = 32 * w + word.bit_length() - 1
    return (token if token < compiler.vocab_size else None), bitmask


def prune(tokens: list[int], children: list[list[int]], matcher):
    """The nodes of a draft tree the grammar allows: walk every path with the matcher (accept,
    recurse, roll back) and keep a node only if its token is accepted after its ancestors'.
    Returns the kept original node indices, parents first (the root is always kept)."""
    keep = [0]

    def visit(node: int) -> None:
        if matcher.is_terminated():  # the node is a stop token: nothing follows it
            return
        for c in children[node]:
            if matcher.accept_token(tokens[c]):
                keep.append(c)
                visit(c)
                matcher.rollback(1)

    visit(0)
    return keep
