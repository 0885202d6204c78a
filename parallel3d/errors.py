"""Errors a user can cause.

Anything the user can fix (a config value, a layout, a path) raises :class:`UserError`
(a ``ValueError``). The CLI turns it into one line on stderr and exit status 2, with no
traceback; library callers get an ordinary exception.
"""

from __future__ import annotations

import difflib

EXIT_USAGE = 2
EXIT_STOPPED = 3  # reliability.on_nonfinite = "stop" ended the run
EXIT_COMM = 4  # a collective timed out or a peer died; the survivors' report says which


class UserError(ValueError):
    """A mistake in input the user controls; the message says what to change."""


def did_you_mean(word: str, choices) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""
