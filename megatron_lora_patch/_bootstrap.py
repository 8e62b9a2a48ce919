"""Start-up hook, run from `megatron_lora_patch-init.pth` only when MEGATRON_PLUGINS is set.

Standard library only (interpreter start-up must stay cheap): it installs a one-shot
meta-path finder that waits for the first `import megatron` and then hands over to
`megatron_lora_patch.runtime.activate_from_env`, which loads the named plugins and
registers wrapt post-import hooks for their target modules (`megatron` is a namespace
package, so the hand-over happens when it is looked up, not after it executes). Any error is reported once
on stderr and swallowed (a broken plugin must never break start-up or `import megatron`),
unless MEGATRON_LORA_STRICT is on.
"""

import os
import sys

WATCHED_PACKAGE = "megatron"
STRICT_VARIABLE = "MEGATRON_LORA_STRICT"


def strict_requested() -> bool:
    """Strict mode as far as start-up can tell (the runtime validates the value fully)."""
    return os.environ.get(STRICT_VARIABLE, "").strip().lower() in ("1", "true", "yes", "on")


def report_failure(where: str, error: BaseException) -> None:
    """One line on stderr; re-raise in strict mode."""
    if strict_requested():
        raise error
    sys.stderr.write(
        f"megatron-lora-patch: {where} failed, no patch applied: {type(error).__name__}: {error}"
        f" (set {STRICT_VARIABLE}=1 to raise instead)\n"
    )


class _MegatronWatcher:
    """A meta-path finder (duck-typed: importing importlib.abc would cost start-up time) that finds nothing itself. On the first lookup of `megatron` it removes itself and
    activates the runtime, which only registers post-import hooks (it never imports
    Megatron), so every patch target imported from then on gets patched."""

    def find_spec(self, fullname, path, target=None):  # type: ignore[no-untyped-def]
        if fullname == WATCHED_PACKAGE:
            sys.meta_path.remove(self)
            activate("activation on `import megatron`")
        return None


def activate(where: str) -> None:
    try:
        from megatron_lora_patch import runtime

        runtime.activate_from_env()
    except Exception as error:  # the user's import must survive a broken plugin
        report_failure(where, error)


def install() -> None:
    """Entry point of the `.pth` line; idempotent."""
    if WATCHED_PACKAGE in sys.modules:  # imported before us: not possible from .pth, possible by hand
        activate("activation")
    elif not any(isinstance(finder, _MegatronWatcher) for finder in sys.meta_path):
        sys.meta_path.insert(0, _MegatronWatcher())
