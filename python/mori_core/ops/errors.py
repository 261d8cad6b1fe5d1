"""The exception the EP ops raise when a kernel reported a failure (shared by every engine)."""

from __future__ import annotations


class EpOpError(RuntimeError):
    """A dispatch/combine kernel reported a failure; the op is unusable afterwards."""
