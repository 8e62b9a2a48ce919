"""Start-up hook, run from `megatron_lora_patch-init.pth` only when MEGATRON_PLUGINS is set.

Standard library only (interpreter start-up must stay cheap): it installs a one-shot
meta-path finder that waits for the first `import megatron` and then hands over to
`megatron_lora_patch.runtime.registry.activate_from_env`, which loads the named plugins and
registers wrapt post-import hooks for their target modules (`megatron` is a namespace
package, so the hand-over happens when it is looked up, not after it executes).

Fail closed (docs/fail-closed.md): the user asked for plugins, so an error here is NOT
swallowed. A configuration mistake (a `UsageError`) makes `import megatron` fail and the
process end with one line; anything else is a bug and keeps its traceback.
"""

import os
import sys

WATCHED_PACKAGE = "megatron"
PTH_NAME = "megatron_lora_patch-init.pth"
_installed = False  # set by `install`, i.e. the `.pth` line ran in this process


class _MegatronWatcher:
    """A meta-path finder (duck-typed: importing importlib.abc would cost start-up time) that finds nothing itself. On the first lookup of `megatron` it removes itself and
    activates the runtime, which only registers post-import hooks (it never imports
    Megatron), so every patch target imported from then on gets patched."""

    def find_spec(self, fullname, path, target=None):  # type: ignore[no-untyped-def]
        if fullname == WATCHED_PACKAGE:
            sys.meta_path.remove(self)
            activate()
        return None


def activate() -> None:
    from megatron_lora_patch.runtime import registry

    registry.activate_from_env()


def install() -> None:
    """Entry point of the `.pth` line; idempotent."""
    global _installed
    _installed = True
    if WATCHED_PACKAGE in sys.modules:  # imported before us: not possible from .pth, possible by hand
        activate()
    elif not any(isinstance(finder, _MegatronWatcher) for finder in sys.meta_path):
        sys.meta_path.insert(0, _MegatronWatcher())


def startup_hook() -> dict:
    """Where the `.pth` start-up hook is installed and whether it works (for `status`).

    A `.pth` file runs only from a site directory (not from any other `sys.path` entry), and
    not at all under `python -S`. `installed`: in a site directory on `sys.path`, so a fresh
    `python` runs it; `ran_here`: it ran in this process (it does when MEGATRON_PLUGINS is set)."""
    import site

    site_dirs = list(site.getsitepackages()) if hasattr(site, "getsitepackages") else []
    if site.ENABLE_USER_SITE:
        site_dirs.append(site.getusersitepackages())
    on_path = {os.path.realpath(entry) for entry in sys.path if entry}
    found = [
        os.path.join(directory, PTH_NAME)
        for directory in site_dirs
        if os.path.realpath(directory) in on_path and os.path.isfile(os.path.join(directory, PTH_NAME))
    ]
    return {
        "path": found[0] if found else None,
        "installed": bool(found),
        "ran_here": _installed,
    }
