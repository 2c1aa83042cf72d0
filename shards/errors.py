"""Errors raised by the model layer: one base, one subclass per kind of problem."""

from __future__ import annotations

from collections.abc import Iterable


class ShardsError(Exception):
    """Base of every error raised by ``shards``."""


class ModelNotFoundError(ShardsError):
    """The named model is not in the model store."""


class ModelFormatError(ShardsError):
    """A model file is corrupt, truncated or holds values ncm cannot use."""


class UnsupportedArchitectureError(ModelFormatError):
    """The model's architecture is not one ncm can run."""


class UnmappedTensorError(ModelFormatError):
    """A checkpoint holds tensors the importer would not use: importing it anyway would
    silently drop weights, so the import is refused. ``names`` holds every such tensor."""

    def __init__(self, message: str, names: Iterable[str] = ()) -> None:
        super().__init__(message)
        self.names = tuple(names)


class TokenizerError(ShardsError):
    """The model's tokenizer or chat template is missing or unusable."""


class SamplingError(ShardsError):
    """Sampling parameters are out of range (a caller error)."""


class GrammarError(SamplingError):
    """A grammar (a JSON schema, a tool format) cannot constrain sampling (a caller error)."""


class FragmentError(ShardsError):
    """A layer fragment cannot be built for the requested layers or shapes."""


class RunnerError(ShardsError):
    """A fragment runner was used wrongly (unknown session, wrong input shape...)."""


class RknnUnavailableError(RunnerError):
    """RKNN cannot run here: no converter environment, no lite runtime or librknnrt.so, no board."""


class RknnConversionError(RunnerError):
    """The RKNN converter refused a fragment, or the NPU (or its simulator) could not run it."""


class CorruptWeightsError(ModelFormatError):
    """Stored weight files do not match the sha256 of the model's manifest (``paths``: which)."""

    def __init__(self, message: str, paths: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.paths = paths
