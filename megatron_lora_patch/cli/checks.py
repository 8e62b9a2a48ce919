"""Checks of command-line values that `oracle` and `preflight` share, run before any rank starts: a timeout
the launcher can wait for, and a report path that can be written (tried, not guessed), so a run of minutes
never ends in a traceback over its own options. Each refusal is one `UsageError` line naming option and value."""

from __future__ import annotations

import math
import os
import tempfile
from typing import Union

from megatron_lora_patch.runtime.errors import UsageError

#: The longest timeout accepted: a week (the launcher's waits overflow near 25 days; no run of ours needs more).
MAX_TIMEOUT_S = 7 * 24 * 3600


def seconds(option: str, text: Union[str, float]) -> float:
    """`text` as seconds in (0, MAX_TIMEOUT_S], or one line naming the accepted range."""
    try:
        value = float(text)
    except (TypeError, ValueError):
        value = math.nan
    if not 0 < value <= MAX_TIMEOUT_S:
        raise UsageError(
            f"{option} must be a number of seconds above 0 and at most {MAX_TIMEOUT_S} (a week), got {text!r}"
        )
    return value


def check_writable(option: str, path: str) -> None:
    """The report can be written at `path`: its directory exists and takes a file (tried, not guessed)."""
    if not path:
        raise UsageError(f"{option} is empty; give a file path for the report")
    directory = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise UsageError(
            f"{option} {path}: is a directory; give a file path such as {os.path.join(path, 'oracle.out')}"
        )
    if not os.path.isdir(directory):
        problem = "is not a directory" if os.path.exists(directory) else "does not exist"
        raise UsageError(f"{option} {path}: {directory} {problem}; create the directory or choose another path")
    try:
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as error:
        raise UsageError(
            f"{option} {path}: cannot write in {directory} ({error.strerror}); choose another path"
        ) from None
