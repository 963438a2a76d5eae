"""The error a configuration raises, apart from the configs so that the readers in validation.py can raise it too."""

from __future__ import annotations

__all__ = ["ConfigError"]


class ConfigError(ValueError):
    """A configuration value is out of range, inconsistent or unsupported."""
