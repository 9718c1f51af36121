"""User-facing errors. The CLI prints these as one line and exits non-zero, without a traceback."""


class SpecDecodeError(Exception):
    """Base class for errors caused by the user's input, not by a bug."""


class ModelNotFoundError(SpecDecodeError):
    pass


class UnsupportedModelError(SpecDecodeError):
    pass


class CorruptModelError(SpecDecodeError):
    pass


class InvalidRequestError(SpecDecodeError, ValueError):
    """Bad sampling values, a prompt longer than the context, an empty prompt (a ValueError
    too: code written for vLLM catches that)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param  # the request field at fault, when known (OpenAI error bodies)


class DataError(SpecDecodeError, ValueError):
    """Training data or a checkpoint to continue from that does not fit the run."""


class OutOfMemoryError(SpecDecodeError):
    """The KV cache cannot hold a sequence even when it runs alone."""
