"""The one error type of checkpoint code: a :class:`~parallel3d.errors.UserError` (the
user can pick another checkpoint or fix the path), always naming the file concerned."""

from __future__ import annotations

from parallel3d.errors import UserError


class CheckpointError(UserError):
    """A checkpoint that cannot be read or written as asked; the message names the file."""
