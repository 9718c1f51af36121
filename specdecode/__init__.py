"""specdecode: a speculative-decoding inference engine."""

from specdecode.core import CompletionOutput, Logprob, RequestOutput
from specdecode.errors import InvalidRequestError
from specdecode.llm import LLM
from specdecode.sampling import SamplingParams

__all__ = [
    "LLM",
    "SamplingParams",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
    "InvalidRequestError",
]
__version__ = "0.1.0"
