"""The loaders' error, in a module of its own so that code which runs before torch is imported can raise it."""

__all__ = ["ModelLoadError"]


class ModelLoadError(RuntimeError):
    """A checkpoint is missing, corrupt, or does not match the architecture it claims."""
