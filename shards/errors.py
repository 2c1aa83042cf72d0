"""Errors raised by the model layer: one base, one subclass per kind of problem."""


class ShardsError(Exception):
    """Base of every error raised by ``shards``."""


class ModelNotFoundError(ShardsError):
    """The named model is not in the model store."""


class ModelFormatError(ShardsError):
    """A model file is corrupt, truncated or holds values ncm cannot use."""


class UnsupportedArchitectureError(ModelFormatError):
    """The model's architecture is not one ncm can run."""


class TokenizerError(ShardsError):
    """The model's tokenizer or chat template is missing or unusable."""


class SamplingError(ShardsError):
    """Sampling parameters are out of range (a caller error)."""


class FragmentError(ShardsError):
    """A layer fragment cannot be built for the requested layers or shapes."""


class RunnerError(ShardsError):
    """A fragment runner was used wrongly (unknown session, wrong input shape...)."""
