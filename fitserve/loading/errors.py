"""Errors raised while reading model files.

Every bad-input path in :mod:`fitserve.loading` raises :class:`ModelLoadError` (or a subclass),
with a message that names the file and the problem, so a user can act on it without a traceback.
"""

from __future__ import annotations

from fitserve.config import SUPPORTED_ARCHITECTURES


class ModelLoadError(ValueError):
    """A model file or folder could not be loaded: missing, corrupt or unsupported."""


class UnsupportedArchitectureError(ModelLoadError):
    """The model's architecture is not one the engine runs."""

    def __init__(self, architecture: str, source: object) -> None:
        self.architecture = architecture
        super().__init__(
            f"{source}: unsupported architecture {architecture!r}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )


class UnsupportedTensorTypeError(ModelLoadError):
    """A tensor is stored in a type the loader cannot dequantize."""

    def __init__(
        self, tensor: str, type_name: str, supported: tuple[str, ...], source: object
    ) -> None:
        self.tensor = tensor
        self.type_name = type_name
        super().__init__(
            f"{source}: tensor {tensor!r} has unsupported type {type_name}; "
            f"supported: {', '.join(supported)}"
        )


class MissingTensorError(ModelLoadError):
    """Tensors the architecture needs are absent from the file(s)."""

    def __init__(self, missing: list[str], source: object) -> None:
        self.missing = list(missing)
        shown = ", ".join(missing[:8]) + (
            f" ... ({len(missing)} in all)" if len(missing) > 8 else ""
        )
        super().__init__(f"{source}: missing tensors: {shown}")
