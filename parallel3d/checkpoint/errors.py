"""The one error type of checkpoint code: a :class:`~parallel3d.errors.UserError` (the
user can pick another checkpoint or fix the path), always naming the file concerned."""

from __future__ import annotations

import json
from pathlib import Path

from parallel3d.errors import UserError


class CheckpointError(UserError):
    """A checkpoint that cannot be read or written as asked; the message names the file."""


def read_json_object(path: Path, what: str) -> dict:
    """The JSON object in ``path`` (``what`` names it in errors: "a checkpoint index").
    Anything else (unreadable, not UTF-8, not JSON, a pickle, another JSON type) is a
    :class:`CheckpointError` naming the file; a missing file raises FileNotFoundError, for
    the caller to say what it expected there."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path} cannot be read as {what}: {e}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} is not {what} (a JSON {type(data).__name__}, not an object)")
    return data
