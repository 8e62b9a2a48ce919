"""User errors versus bugs (pytest's `UsageError` convention; docs/fail-closed.md).

A `UsageError` is a mistake the user can fix (a bad flag, an unknown name, a path that cannot be
written): it is reported as ONE line naming the problem and the fix, never as a traceback, and
the process stops before any training step. Every other exception is a bug and keeps its traceback.

`install_excepthook` makes an uncaught `UsageError` print that one line in any process the plugin
activates in (a `torchrun` rank, `pretrain_gpt.py`), while library callers can still catch it.
Standard library only: this module is imported on the start-up path.
"""

import sys

PREFIX = "megatron-lora-patch: error: "


class UsageError(Exception):
    """A user mistake; `str(error)` is the whole one-line message (what, the value, the fix)."""


def one_line(error: BaseException) -> str:
    """The message a user sees for `error`: the prefix and the first line of its text."""
    text = str(error).strip().splitlines()
    return PREFIX + (text[0] if text else type(error).__name__)


def _usage_excepthook(previous):
    def hook(kind, value, traceback):
        if isinstance(value, UsageError):
            sys.stderr.write(one_line(value) + "\n")
            sys.stderr.flush()
        else:
            previous(kind, value, traceback)

    hook._megatron_lora_patch = True  # type: ignore[attr-defined]
    return hook


def install_excepthook() -> None:
    """Print an uncaught UsageError as one line (exit status 1); idempotent."""
    if not getattr(sys.excepthook, "_megatron_lora_patch", False):
        sys.excepthook = _usage_excepthook(sys.excepthook)
