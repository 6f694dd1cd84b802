"""What every configuration section's check raises: :class:`ConfigError`, led by the field.

Each section (a dataclass) lives with the module that owns it and checks itself;
hier_localsgd/config.py composes them. This module sits at the bottom of the package
so any layer can raise the error without importing the root config.
"""

from __future__ import annotations

from typing import NoReturn


class ConfigError(ValueError):
    """A configuration value is invalid; the message starts with the field's path."""


def fail(path: str, msg: str) -> NoReturn:
    """Raises :class:`ConfigError` for ``path`` (e.g. ``"sync.inner.every"``)."""
    raise ConfigError(f"{path}: {msg}")
