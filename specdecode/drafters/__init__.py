from specdecode.drafters.base import Drafter, DraftProposal

__all__ = ["DraftProposal", "Drafter"]
