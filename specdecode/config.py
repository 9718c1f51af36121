"""Frozen configuration dataclasses.

`ModelConfig` is the engine's view of a Llama-family checkpoint; it is read from a Hugging Face
`config.json` (or built from GGUF metadata) and never mutated afterwards.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

from specdecode.errors import UnsupportedModelError

log = logging.getLogger(__name__)

# Hugging Face `architectures[0]` -> our family name. The family decides the small differences:
# qkv bias (Qwen2), q/k RMSNorm (Qwen3); everything else is the Llama block.
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    # None, ("linear", factor) or ("llama3", factor, low_freq, high_freq, original_max_len)
    scaling: tuple[Any, ...] | None = None


@dataclass(frozen=True)
class ModelConfig:
    family: str  # "llama" | "mistral" | "qwen2" | "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v projections (Qwen2)
    qk_norm: bool  # RMSNorm on q and k per head (Qwen3)
    rope: RopeConfig = field(default_factory=RopeConfig)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else None
        if arch not in SUPPORTED_ARCHITECTURES:
            supported = ", ".join(SUPPORTED_ARCHITECTURES)
            raise UnsupportedModelError(
                f"unsupported architecture {arch!r}; supported: {supported}"
            )
        family = SUPPORTED_ARCHITECTURES[arch]
        if family in ("llama", "mistral"):
            for flag, where in (("attention_bias", "q/k/v/o"), ("mlp_bias", "MLP")):
                if cfg.get(flag):
                    raise UnsupportedModelError(
                        f"{flag}: biases on the {where} projections of a {arch} are not supported"
                    )
        try:
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            eos = cfg.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
            return cls(
                family=family,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_layers=int(cfg["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                rms_norm_eps=float(_given(cfg, "rms_norm_eps", 1e-6)),
                max_position_embeddings=_context_length(cfg, family),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                attention_bias=family == "qwen2" or bool(cfg.get("attention_bias", False)),
                qk_norm=family == "qwen3",
                rope=rope_from_hf(cfg),
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=eos_ids,
            )
        except KeyError as e:
            raise UnsupportedModelError(f"config.json is missing the field {e.args[0]!r}") from e

    @property
    def hf_architecture(self) -> str:
        """The Hugging Face `architectures[0]` of this family."""
        return next(a for a, f in SUPPORTED_ARCHITECTURES.items() if f == self.family)

    def hf_dict(self, num_layers: int | None = None) -> dict[str, Any]:
        """The Hugging Face config.json keys of this shape (drafts and heads write these with
        their own layer count), RoPE scaling included."""
        out = {
            "model_type": self.family,  # the Hugging Face model_type of each family
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers if num_layers is None else num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope.theta,
            "max_position_embeddings": self.max_position_embeddings,
            "attention_bias": self.attention_bias,
            "tie_word_embeddings": False,
        }
        sc = self.rope.scaling
        if sc and sc[0] == "linear":
            out["rope_scaling"] = {"rope_type": "linear", "factor": sc[1]}
        elif sc and sc[0] == "llama3":
            out["rope_scaling"] = {
                "rope_type": "llama3",
                "factor": sc[1],
                "low_freq_factor": sc[2],
                "high_freq_factor": sc[3],
                "original_max_position_embeddings": sc[4],
            }
        return out


def _given(cfg: dict[str, Any], key: str, default):
    """`cfg[key]`, or `default` where it is absent or null."""
    value = cfg.get(key)
    return default if value is None else value


def _context_length(cfg: dict[str, Any], family: str) -> int:
    """The positions the model attends over in full. A sliding window (Mistral v0.1; Qwen's
    `use_sliding_window`) narrower than that caps the context at the window, where full
    attention and the window's agree; past it they would not, and no window is implemented."""
    n = int(_given(cfg, "max_position_embeddings", 2048))
    window = cfg.get("sliding_window")
    if family == "mistral" or cfg.get("use_sliding_window"):
        if window is not None and 0 < int(window) < n:
            log.info("context capped at the sliding window: %d of %d positions", window, n)
            return int(window)
    return n


def rope_from_hf(cfg: dict[str, Any]) -> RopeConfig:
    rs = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    if rs is not None and not isinstance(rs, dict):
        raise UnsupportedModelError(f"rope_scaling is not an object: {rs!r}")
    theta = float(cfg.get("rope_theta") or (rs or {}).get("rope_theta") or 10000.0)
    if not rs:
        return RopeConfig(theta=theta)
    kind = rs.get("rope_type") or rs.get("type") or "default"
    if kind == "default":
        return RopeConfig(theta=theta)
    if kind == "linear":
        return RopeConfig(theta=theta, scaling=("linear", float(rs["factor"])))
    if kind == "llama3":
        return RopeConfig(
            theta=theta,
            scaling=(
                "llama3",
                float(rs["factor"]),
                float(rs["low_freq_factor"]),
                float(rs["high_freq_factor"]),
                int(rs["original_max_position_embeddings"]),
            ),
        )
    raise UnsupportedModelError(f"unsupported rope scaling type {kind!r}")


@dataclass(frozen=True)
class EngineConfig:
    """Engine settings; flag names follow vLLM (`--max-model-len`, `--max-num-seqs`, ...)."""

    model: str | None = None  # directory, .gguf file, or None for the embedded default
    dtype: str = "float32"  # "float32" | "bfloat16" | "float16" | "auto" (see auto_dtype)
    device: str = "auto"  # "auto" picks CUDA when present
    max_model_len: int | None = None  # default: the model's context length
    # KV cache budget; on a CPU pages are committed only as tokens arrive, a GPU allocates it
    kv_cache_memory_gb: float = 2.0
    # vLLM's: on CUDA, the KV cache takes what this fraction of the GPU's memory leaves after
    # the weights (in place of kv_cache_memory_gb); no effect on a CPU
    gpu_memory_utilization: float | None = None
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    allow_pickle: bool = False
    seed: int = 0  # global seed for requests without their own
    speculative_config: SpeculativeConfig | dict | None = None
    # adaptive: the goodput controller picks each request's draft depth every step; static:
    # always num_speculative_tokens (vLLM); off: never draft. See engine/controller.py.
    speculative_policy: str = "adaptive"
    kernels: str = "auto"  # "auto": packed weights + C++ layer loop on capable CPUs; "off"
    # a Jinja chat template (a file, or the template itself) instead of the tokenizer's, as
    # vLLM's --chat-template
    chat_template: str | None = None
    # reuse the keys and values of earlier requests' identical first tokens (vLLM's automatic
    # prefix caching)
    enable_prefix_caching: bool = True
    # vLLM's --scheduling-policy: "fcfs" (arrival order) or "priority" (each request's
    # priority, lower first, then arrival: the waiting order, and who is preempted first)
    scheduling_policy: str = "fcfs"
    # the target's projections quantized at load for the CPU kernels: "int8" (SGLang's
    # w8a8_int8: int8 weights per output row, activations to int8 per token with vpdpbusd on
    # AVX512_VNNI, weight-only without) or
    # "int4" (int4 weights, AVX512_VNNI); None: as loaded. A quantized target is another
    # model: speculation stays exact with respect to it, not to the unquantized one
    quantization: str | None = None

    def __post_init__(self) -> None:
        """Values the engine would misread or run crippled with, refused at once (the flags'
        types check the command line; this checks the Python API the same way)."""
        from specdecode.errors import InvalidRequestError
        from specdecode.sampling import _integer as integer
        from specdecode.sampling import _number as number

        if self.dtype == "auto":  # (frozen: set once, here, to what it stands for)
            object.__setattr__(self, "dtype", auto_dtype(self.device))

        gb = self.kv_cache_memory_gb
        if not number(gb) or gb <= 0:
            raise InvalidRequestError(f"kv_cache_memory_gb must be above 0, got {gb!r}")
        frac = self.gpu_memory_utilization
        if frac is not None and (not number(frac) or not 0 < frac <= 1):
            raise InvalidRequestError(f"gpu_memory_utilization must be in (0, 1], got {frac!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            if not integer(getattr(self, name)) or getattr(self, name) < 1:
                raise InvalidRequestError(f"{name} must be at least 1, got {getattr(self, name)!r}")
        if self.max_model_len is not None and (
            not integer(self.max_model_len) or self.max_model_len < 1
        ):
            raise InvalidRequestError(
                f"max_model_len must be at least 1, got {self.max_model_len!r}"
            )
        if self.quantization not in (None, "int8", "int4"):
            raise InvalidRequestError(
                f"quantization must be int8, int4 or None, got {self.quantization!r}"
            )
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise InvalidRequestError(
                f"scheduling_policy must be fcfs or priority, got {self.scheduling_policy!r}"
            )
        if not integer(self.seed):
            raise InvalidRequestError(f"seed must be an integer, got {self.seed!r}")
        for name in ("allow_pickle", "enable_prefix_caching"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidRequestError(
                    f"{name} must be True or False, got {getattr(self, name)!r}"
                )
        if self.speculative_policy not in SPECULATIVE_POLICIES:
            raise InvalidRequestError(
                f"unknown speculative policy {self.speculative_policy!r}; choose from "
                f"{', '.join(SPECULATIVE_POLICIES)}"
            )


SPECULATIVE_POLICIES = ("adaptive", "static", "off")  # see engine/controller.py


def auto_dtype(device: str) -> str:
    """vLLM's default `dtype="auto"`: bfloat16 where the engine runs on CUDA (as vLLM serves
    these models there; float16 on GPUs older than Ampere, which have no fast bfloat16, as
    vLLM falls back), float32 on a CPU (exact, and the fast paths here are tuned for it; pass
    bfloat16 for speed)."""
    import torch

    cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    if not cuda:
        return "float32"
    if not torch.cuda.is_available():  # (the device's own check says it is missing)
        return "bfloat16"
    index = torch.device(device).index if device.startswith("cuda") else None
    major, _ = torch.cuda.get_device_capability(index)
    return "bfloat16" if major >= 8 else "float16"


SPECULATIVE_METHODS = ("ngram", "suffix", "draft_model", "medusa", "eagle", "eagle3")
# Methods a lookup branch can join (a draft model's chain sampled from q takes none).
LOOKUP_BRANCH_METHODS = ("draft_model", "medusa", "eagle", "eagle3")
# Drafters whose LM head scores target ids, which a token map (FR-Spec) can restrict.
TOKEN_MAP_METHODS = ("eagle", "medusa", "draft_model")
DRAFT_DTYPES = ("float32", "bfloat16", "float16", "int8", "int4")
QUANTIZED_DRAFT_DTYPES = ("int8", "int4")  # packed by the CPU kernels only


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's `--speculative-config` keys. `num_speculative_tokens` is the draft depth k."""

    method: str
    model: str | None = None  # draft model (draft_model), head directory (later methods)
    num_speculative_tokens: int = 5
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    # The draft only proposes, so it may run in lower precision: "float32" | "bfloat16" |
    # "float16" | "int8" (per-row scales) | "int4" (a scale per 128 k's; needs AVX512_VNNI).
    # int8 / int4 need the CPU kernels; with AVX512_VNNI the activations are quantised per row
    # to int8 as well (vpdpbusd), else int8 is weight-only.
    draft_dtype: str | None = None
    # draft_model: keep only the first N token ids (plus special tokens) in the draft's LM head.
    # Byte-level BPE numbers tokens in merge order, so low ids are the frequent pieces (a
    # data-free stand-in for FR-Spec's frequency ranking, Zhao et al. 2025): a 152k-token head
    # is 27% of Qwen2.5-0.5B's weights. Drafts stay proposals: exactness is untouched.
    draft_vocab_size: int | None = None
    # SGLang's --speculative-token-map (FR-Spec, Zhao et al. 2025): a file of target token ids
    # (.json, .safetensors; .pt with --allow-pickle) the drafter's LM head keeps; the end of
    # sequence ids are always kept. Methods eagle, medusa and draft_model (an EAGLE-3 head has
    # its own draft vocabulary, d2t). Drafts stay proposals: exactness is untouched.
    token_map: str | None = None
    # Static draft tree as a choice list (vLLM's key; a JSON string or a list), e.g.
    # [[0], [1], [0, 0], [1, 0], [0, 0, 0]]: top-2 children of the root, then chains below.
    speculative_token_tree: Any = None
    # EAGLE-2 dynamic tree (SGLang's --speculative-eagle-topk / --speculative-num-draft-tokens;
    # its --speculative-num-steps is num_speculative_tokens): children expanded per node and
    # nodes kept, the root included. topk 1 drafts a chain. None: the method's default.
    topk: int | None = None
    num_draft_tokens: int | None = None
    # Heads (medusa, eagle, eagle3) and draft models: also look the request's last n-gram up in
    # its own prompt and output (prompt_lookup_min..max, as the ngram method) and graft the
    # continuation, up to this many tokens, onto the draft tree as one more branch; both are
    # verified in the same forward. None: off. Pays where answers copy their input (code edits,
    # a function repeated with its docstring), costs a few tree nodes elsewhere. A draft model's
    # chain sampled from q (temperature > 0, no speculative_token_tree) takes no graft: there
    # the lookup runs instead of the draft, on steps where it has done as well for the time.
    prompt_lookup_tokens: int | None = None
    # Where the lookup branch's chain comes from: "ngram" (the last n-gram's most recent match,
    # as above) or "suffix" (the likeliest path of suffix decoding's tree over the request's
    # text and the answers of earlier requests; the suffix_decoding_* keys below apply).
    prompt_lookup_method: str = "ngram"
    # vLLM's switch, a hard cap under every policy: no drafts while more requests than this are
    # running. None: never.
    disable_by_batch_size: int | None = None
    # Suffix decoding (method "suffix", vLLM's keys and their defaults; `num_speculative_tokens`
    # keeps this project's 5 and caps a draft tree's nodes): the suffix matched plus the draft
    # stay within max_tree_depth; a match of n tokens drafts at most max_spec_factor * n; tokens
    # whose share of the matches' continuations is below min_token_prob are not drafted; the
    # answers of the last max_cached_requests requests (at most corpus_tokens tokens) are drafted
    # from besides the request's own text (0: its own text only; the corpus holds other
    # requests' answers, whose effect on timing a multi-tenant server may not want).
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    suffix_decoding_corpus_tokens: int = 1_000_000

    @property
    def load_dtype(self) -> str | None:
        """The dtype to load the draft's weights in: `draft_dtype`, except for int8 / int4,
        which load in the target's dtype (None) and are quantised when packed."""
        return None if self.draft_dtype in QUANTIZED_DRAFT_DTYPES else self.draft_dtype

    def __post_init__(self) -> None:
        from specdecode.errors import InvalidRequestError

        self._check_types()
        tree = self.speculative_token_tree
        if isinstance(tree, str):
            import json

            try:
                tree = json.loads(tree)
            except json.JSONDecodeError as e:
                raise InvalidRequestError(f"speculative_token_tree is not JSON: {e}") from e
        if tree is not None:
            from specdecode.tree import TreeShape

            if (
                not isinstance(tree, (list, tuple))
                or not tree
                or not all(
                    isinstance(c, (list, tuple))
                    and c
                    and all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in c)
                    for c in tree
                )
            ):
                raise InvalidRequestError(
                    "speculative_token_tree must be a non-empty list of choices, each a list of "
                    f"child ranks (integers >= 0), e.g. [[0], [1], [0, 0]]; got {tree!r:.80}"
                )
            if len({tuple(c) for c in tree}) < len(tree):
                raise InvalidRequestError("speculative_token_tree lists a choice twice")

            try:
                TreeShape.from_choices(tree)
            except (TypeError, ValueError) as e:
                raise InvalidRequestError(f"invalid speculative_token_tree: {e}") from e
            object.__setattr__(self, "speculative_token_tree", [list(c) for c in tree])
        if self.method not in SPECULATIVE_METHODS:
            raise InvalidRequestError(
                f"unknown speculative method {self.method!r}; "
                f"choose from {', '.join(SPECULATIVE_METHODS)}"
            )
        if self.num_speculative_tokens < 1:
            raise InvalidRequestError("num_speculative_tokens must be a positive integer")
        if self.method == "ngram" and self.model is not None:  # which one was meant?
            raise InvalidRequestError(
                f"method ngram drafts from the prompt and takes no model (got {self.model!r})"
            )
        if self.method == "suffix":
            self._check_suffix()
        if self.prompt_lookup_method not in ("ngram", "suffix"):
            raise InvalidRequestError("prompt_lookup_method must be 'ngram' or 'suffix'")
        if self.prompt_lookup_method == "suffix":
            if self.prompt_lookup_tokens is None:
                raise InvalidRequestError(
                    "prompt_lookup_method picks the lookup branch's source: it needs "
                    "prompt_lookup_tokens"
                )
            self._check_suffix_numbers()
        if self.topk is not None and self.topk < 1:  # (types: _check_types)
            raise InvalidRequestError("topk must be a positive integer")
        if self.num_draft_tokens is not None and self.num_draft_tokens < 2:
            raise InvalidRequestError("num_draft_tokens must be an integer >= 2 (root included)")
        chain = self.num_speculative_tokens + 1  # a chain's nodes, the root included
        if self.method not in ("eagle", "eagle3") and (
            self.topk not in (None, 1) or self.num_draft_tokens not in (None, chain)
        ):
            raise InvalidRequestError(
                "topk / num_draft_tokens (SGLang's --speculative-eagle-topk / "
                f"--speculative-num-draft-tokens) other than a chain's (1 / {chain}) shape "
                "EAGLE-2 trees: methods eagle and eagle3 only (a static tree for the others: "
                "speculative_token_tree)"
            )
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise InvalidRequestError("disable_by_batch_size must be a positive integer")
        if self.draft_vocab_size is not None:
            if self.method != "draft_model":
                raise InvalidRequestError("draft_vocab_size applies to method draft_model only")
            if self.draft_vocab_size < 2:
                raise InvalidRequestError("draft_vocab_size must be an integer >= 2")
        if self.token_map is not None:
            if self.method not in TOKEN_MAP_METHODS:
                why = (
                    ": an EAGLE-3 head has its own draft vocabulary (d2t), fixed when it was "
                    "trained (`train eagle3 --draft-vocab`)"
                    if self.method == "eagle3"
                    else " (a lookup drafter has no LM head)"
                )
                raise InvalidRequestError(
                    f"token_map (--speculative-token-map) applies to methods "
                    f"{', '.join(TOKEN_MAP_METHODS)}, not to {self.method}{why}"
                )
            if self.draft_vocab_size is not None:
                raise InvalidRequestError(
                    "token_map and draft_vocab_size both choose the draft's vocabulary: give one"
                )
        if self.draft_dtype is not None and self.draft_dtype not in DRAFT_DTYPES:
            raise InvalidRequestError(
                f"unknown draft_dtype {self.draft_dtype!r}; choose from {', '.join(DRAFT_DTYPES)}"
            )
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise InvalidRequestError("need 1 <= prompt_lookup_min <= prompt_lookup_max")
        self._check_applies()
        if self.prompt_lookup_tokens is not None:
            if self.method not in LOOKUP_BRANCH_METHODS:
                raise InvalidRequestError(
                    "prompt_lookup_tokens adds a lookup branch to a drafter's tree: methods "
                    f"{', '.join(LOOKUP_BRANCH_METHODS)} only (method ngram is lookup alone)"
                )
            if self.prompt_lookup_tokens < 1:
                raise InvalidRequestError("prompt_lookup_tokens must be a positive integer")

    def _check_types(self) -> None:
        """Types before values: a wrong-typed value is a clear error, not a Python comparison's
        TypeError (true is not 1, 2.5 is not a count)."""
        from specdecode.errors import InvalidRequestError

        if not isinstance(self.method, str):
            raise InvalidRequestError(f"method must be a string, got {self.method!r}")
        if self.model is not None and not isinstance(self.model, str):
            raise InvalidRequestError(f"model must be a path or a name, got {self.model!r}")
        for key in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "topk",
                    "num_draft_tokens", "disable_by_batch_size", "draft_vocab_size",
                    "prompt_lookup_tokens"):  # fmt: skip
            v = getattr(self, key)
            optional = key not in ("num_speculative_tokens", "prompt_lookup_min",
                                   "prompt_lookup_max")  # fmt: skip
            if (v is not None or not optional) and (not isinstance(v, int) or isinstance(v, bool)):
                least = 2 if key in ("num_draft_tokens", "draft_vocab_size") else 1
                what = "a positive integer" if least == 1 else "an integer >= 2"
                raise InvalidRequestError(f"{key} must be {what}, got {v!r}")
        for key in ("draft_dtype", "prompt_lookup_method", "token_map"):
            v = getattr(self, key)
            if v is not None and not isinstance(v, str):
                raise InvalidRequestError(f"{key} must be a string, got {v!r}")

    def _check_applies(self) -> None:
        """A key that does nothing for this method is refused, not dropped: the user meant
        something by it (each names where it applies)."""
        from dataclasses import fields

        from specdecode.errors import InvalidRequestError

        default = {f.name: f.default for f in fields(self)}
        given = {k for k in default if getattr(self, k) != default[k]}

        def refuse(keys: list[str], where: str) -> None:
            if keys:
                raise InvalidRequestError(
                    f"{', '.join(keys)} {'applies' if len(keys) == 1 else 'apply'} to {where}, "
                    f"not to method {self.method}"
                )

        suffix = self.method == "suffix" or (
            self.prompt_lookup_tokens is not None and self.prompt_lookup_method == "suffix"
        )
        if not suffix:
            keys = sorted(k for k in given if k.startswith("suffix_decoding_"))
            refuse(keys, 'method suffix and a lookup branch with prompt_lookup_method "suffix"')
        ngram = self.method == "ngram" or (
            self.prompt_lookup_tokens is not None and self.prompt_lookup_method == "ngram"
        )
        if not ngram:
            keys = sorted(k for k in given & {"prompt_lookup_min", "prompt_lookup_max"})
            refuse(keys, "method ngram and a lookup branch (prompt_lookup_tokens)")
        if self.method in ("ngram", "eagle", "eagle3") and self.speculative_token_tree is not None:
            refuse(
                ["speculative_token_tree"],
                "static trees of methods draft_model and medusa (EAGLE's trees are dynamic: "
                "topk / num_draft_tokens)",
            )
        if self.method == "ngram" and self.draft_dtype is not None:
            refuse(["draft_dtype"], "a drafter's weights (method ngram has none)")
        if self.topk == 1 and (self.num_draft_tokens or 0) > self.num_speculative_tokens + 1:
            raise InvalidRequestError(
                f"topk 1 drafts a chain of num_speculative_tokens + 1 = "
                f"{self.num_speculative_tokens + 1} nodes: num_draft_tokens "
                f"{self.num_draft_tokens} cannot be reached"
            )

    def _check_suffix(self) -> None:
        from specdecode.errors import InvalidRequestError

        for key in ("model", "speculative_token_tree", "draft_dtype"):
            if getattr(self, key) is not None:
                raise InvalidRequestError(
                    f"method suffix drafts from text, not a model or a static tree ({key})"
                )
        self._check_suffix_numbers()

    def _check_suffix_numbers(self) -> None:
        from specdecode.errors import InvalidRequestError

        def integer(key: str, least: int) -> None:
            v = getattr(self, key)
            if not isinstance(v, int) or isinstance(v, bool) or v < least:
                raise InvalidRequestError(f"{key} must be an integer >= {least}, got {v!r}")

        integer("suffix_decoding_max_tree_depth", 3)
        integer("suffix_decoding_max_cached_requests", 0)
        integer("suffix_decoding_corpus_tokens", 1)

        def number(v) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

        factor = self.suffix_decoding_max_spec_factor
        if not number(factor) or factor <= 0:
            raise InvalidRequestError(
                f"suffix_decoding_max_spec_factor must be a number > 0, got {factor!r}"
            )
        prob = self.suffix_decoding_min_token_prob
        if not number(prob) or not 0 <= prob <= 1:
            raise InvalidRequestError(
                f"suffix_decoding_min_token_prob must be a number in [0, 1], got {prob!r}"
            )

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> SpeculativeConfig:
        from dataclasses import fields

        from specdecode.errors import InvalidRequestError

        if isinstance(raw, str):  # (the command line's JSON, given to the Python API)
            import json

            try:
                raw = json.loads(raw)
            except json.JSONDecodeError as e:
                raise InvalidRequestError(f"the speculative config is not valid JSON: {e}") from e
        if not isinstance(raw, dict):
            raise InvalidRequestError(
                f"the speculative config must be a dict (or its JSON), got {type(raw).__name__}"
            )
        raw = vllm_compat(with_method(raw))
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise InvalidRequestError(f"unknown speculative config keys: {', '.join(unknown)}")
        return cls(**raw)


def with_method(raw: dict[str, Any]) -> dict[str, Any]:
    """`raw` with its method; where it names none, the method its `model` is (as vLLM infers
    one, here from the checkpoint rather than its name): "[ngram]" (vLLM's legacy spelling),
    a head directory (its kind: medusa, eagle, eagle3), a head `models pull` builds, or else a
    model (draft_model)."""
    from pathlib import Path

    from specdecode.errors import InvalidRequestError

    if "method" in raw:
        return raw
    model = raw.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequestError("the speculative config needs a 'method' (or a 'model')")
    from specdecode.models.registry import RECIPES

    if model.strip("[]") == "ngram":
        method = "ngram"
        raw = {k: v for k, v in raw.items() if k != "model"}
    elif model in RECIPES:
        method = RECIPES[model].kind
    else:
        from specdecode.models.head_io import head_kind

        path = Path(model).expanduser()
        method = (head_kind(path) if path.is_dir() else None) or "draft_model"
    return {**raw, "method": method}


# vLLM speculative config keys with nothing to set here: accepted at the value that means what
# this engine does, refused (with why) at any other, rather than "unknown".
_VLLM_KEYS: dict[str, tuple[Any, str]] = {
    "draft_tensor_parallel_size": (
        lambda v: v in (None, 1),
        "the draft runs on the target's one device here",
    ),
    "disable_padded_drafter_batch": (
        lambda v: isinstance(v, bool),
        "a GPU batching switch (no effect here); a boolean",
    ),
    "disable_log_stats": (
        lambda v: isinstance(v, bool),
        "no effect here: acceptance is reported on /metrics and by `bench`; a boolean",
    ),
    "disable_logprobs": (
        lambda v: isinstance(v, bool),
        "requested logprobs are always the target's here; a boolean",
    ),
    "acceptance_method": (
        lambda v: v in (None, "rejection_sampler"),
        "only the lossless rejection sampler is offered (typical acceptance changes the output)",
    ),
    "revision": (lambda v: v in (None, "main"), "nothing is downloaded here: give a local path"),
    "code_revision": (lambda v: v is None, "no remote code runs here"),
    "quantization": (lambda v: v is None, 'the draft\'s weights: use "draft_dtype" (int8, int4)'),
    "max_model_len": (lambda v: v is None, "a draft drafts within its own context here"),
}


def vllm_compat(raw: dict[str, Any]) -> dict[str, Any]:
    """`raw` without the vLLM keys above that hold the value this engine behaves as; a clear
    error for one that asks for something else."""
    from specdecode.errors import InvalidRequestError

    out = dict(raw)
    for key, (fits, why) in _VLLM_KEYS.items():
        if key in out:
            value = out.pop(key)
            if not fits(value):
                raise InvalidRequestError(f"speculative config {key}={value!r}: {why}")
    return out


def kv_budget_gb(total: int, weights: int, fraction: float, reserve: float = 0.1) -> float:
    """The KV cache's share of a GPU (bytes in, GB out): `fraction` of its memory, less the
    weights and a reserve for activations (`reserve` of what is left, at least 256 MiB)."""
    from specdecode.errors import InvalidRequestError

    left = fraction * total - weights
    budget = left - max(reserve * left, 256 << 20)
    if budget <= 0:
        raise InvalidRequestError(
            f"gpu_memory_utilization {fraction:g} allows {fraction * total / 2**30:.2f} GB of "
            f"this GPU's {total / 2**30:.2f} GB; the weights (and a drafter's cache) take "
            f"{weights / 2**30:.2f} GB, leaving no room for the KV cache: raise it"
        )
    return budget / 2**30
