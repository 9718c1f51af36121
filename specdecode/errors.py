"""User-facing errors. The CLI prints these as one line and exits non-zero, without a traceback."""


class SpecDecodeError(Exception):
    """Base class for errors caused by the user's input, not by a bug."""


class ModelNotFoundError(SpecDecodeError):
    pass


class UnsupportedModelError(SpecDecodeError):
    pass


class CorruptModelError(SpecDecodeError):
    pass


class InvalidRequestError(SpecDecodeError):
    """Bad sampling values, a prompt longer than the context, an empty prompt."""


class OutOfMemoryError(SpecDecodeError):
    """The KV cache cannot hold a sequence even when it runs alone."""
