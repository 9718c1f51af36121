"""Builds the drafter a SpeculativeConfig names."""

from __future__ import annotations

from typing import TYPE_CHECKING

from specdecode.config import SpeculativeConfig
from specdecode.drafters.base import Drafter

if TYPE_CHECKING:
    from specdecode.engine.engine import LLMEngine


def build_drafter(config: SpeculativeConfig, engine: LLMEngine) -> Drafter:
    drafter = _build(config, engine)
    if config.prompt_lookup_tokens:
        from specdecode.drafters.lookup_branch import LookupBranchDrafter

        return LookupBranchDrafter(
            drafter,
            config.prompt_lookup_tokens,
            config.prompt_lookup_min,
            config.prompt_lookup_max,
            room=engine.draft_room,
            step_time=lambda n: engine.controller.predict_step_time(n),  # built after this
            source=_suffix(config) if config.prompt_lookup_method == "suffix" else None,
        )
    return drafter


def _suffix(config: SpeculativeConfig):
    from specdecode.drafters.suffix import SuffixDrafter

    return SuffixDrafter(
        config.suffix_decoding_max_tree_depth,
        config.suffix_decoding_max_cached_requests,
        config.suffix_decoding_max_spec_factor,
        config.suffix_decoding_min_token_prob,
        config.suffix_decoding_corpus_tokens,
    )


def _build(config: SpeculativeConfig, engine: LLMEngine) -> Drafter:
    if config.method == "ngram":
        from specdecode.drafters.ngram import NgramDrafter

        return NgramDrafter(config.prompt_lookup_min, config.prompt_lookup_max)
    if config.method == "suffix":
        return _suffix(config)
    if config.method == "draft_model":
        from specdecode.drafters.draft_model import DraftModelDrafter

        return DraftModelDrafter.from_config(config, engine)
    if config.method == "medusa":
        from specdecode.drafters.medusa import MedusaDrafter

        return MedusaDrafter.from_config(config, engine)
    if config.method in ("eagle", "eagle3"):
        from specdecode.drafters.eagle import EagleDrafter

        return EagleDrafter.from_config(config, engine)
    raise ValueError(f"no drafter for method {config.method!r}")
