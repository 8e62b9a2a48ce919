"""Start-up hook, run from `megatron_lora_patch-init.pth` only when a `MEGATRON_*` variable is set.

Standard library only (interpreter start-up must stay cheap): with MEGATRON_PLUGINS set it installs a one-shot
meta-path finder that waits for the first `import megatron` and then hands over to
`megatron_lora_patch.runtime.registry.activate_from_env`, which loads the named plugins and
registers wrapt post-import hooks for their target modules (`megatron` is a namespace
package, so the hand-over happens when it is looked up, not after it executes).

Fail closed (docs/fail-closed.md): the user asked for plugins, so an error here is NOT
swallowed. A configuration mistake (a `UsageError`) makes `import megatron` fail and the
process end with one line; anything else is a bug and keeps its traceback.

Without MEGATRON_PLUGINS the runtime stays off, but a variable that shows the user meant LoRA
(`MEGATRON_LORA_*` set, `MEGATRON_PLUGIN`, a lower-case `megatron_lora_rank`) would otherwise turn a LoRA
job silently into full fine-tuning: the same watcher prints one warning line per such variable at
`import megatron` (docs/fail-closed.md, "Warnings"), so only a process that trains sees it.
"""

import os
import sys

WATCHED_PACKAGE = "megatron"
PTH_NAME = "megatron_lora_patch-init.pth"
PLUGINS_VARIABLE = "MEGATRON_PLUGINS"  # runtime.flags.PLUGINS_VARIABLE (flags is not standard-library only)
LORA_PREFIX = "MEGATRON_LORA_"
WARNING = "megatron-lora-patch: warning: "
#: Modules loaded in every process the `.pth` line armed; any other module of the package means the
#: process uses it from code (the CLI, `apply()`, the testbed's ranks), which configures LoRA itself.
_START_UP_MODULES = ("megatron_lora_patch", "megatron_lora_patch.runtime", "megatron_lora_patch.runtime.bootstrap")
_installed = False  # set by `install` when MEGATRON_PLUGINS is set, i.e. the runtime hook is armed


class _MegatronWatcher:
    """A meta-path finder (duck-typed: importing importlib.abc would cost start-up time) that finds
    nothing itself. On the first lookup of `megatron` it removes itself, prints the environment
    warnings, and (`requested`) activates the runtime, which only registers post-import hooks (it
    never imports Megatron), so every patch target imported from then on gets patched."""

    def __init__(self, requested: bool = True) -> None:
        self.requested = requested

    def find_spec(self, fullname, path, target=None):  # type: ignore[no-untyped-def]
        if fullname == WATCHED_PACKAGE:
            sys.meta_path.remove(self)
            warn_environment(self.requested)
            if self.requested:
                activate()
        return None


def environment_warnings(environ, requested: bool, in_code: bool = False) -> list:
    """One line per set variable that shows LoRA was meant but will not be read (an empty value is unset):
    a near miss of MEGATRON_PLUGINS, a `MEGATRON_LORA_*` name in the wrong case, and, with MEGATRON_PLUGINS
    unset and the package not used from code (`in_code`), the first `MEGATRON_LORA_*` variable."""
    lines, lora = [], []
    for key in sorted(key for key, value in environ.items() if value.strip()):
        upper = key.upper()
        if upper.startswith("MEGATRON_PLUGIN") and key != PLUGINS_VARIABLE:
            lines.append(f"{key} is not a variable megatron-lora-patch reads; did you mean {PLUGINS_VARIABLE}?")
        elif upper.startswith(LORA_PREFIX) and not key.startswith(LORA_PREFIX):
            lines.append(f"{key} is not read (variable names are case-sensitive); rename it {upper}")
        elif key.startswith(LORA_PREFIX):
            lora.append(key)
    if lora and not requested and not in_code:
        lines.append(
            f"{lora[0]} is set but {PLUGINS_VARIABLE} is not, so no LoRA is applied and training updates every "
            f"weight; set {PLUGINS_VARIABLE}=lora_correct (or call megatron_lora_patch.apply() in code)"
        )
    return lines


def warn_environment(requested: bool) -> None:
    """Print `environment_warnings` for this process to stderr (standard library only)."""
    in_code = any(name.startswith("megatron_lora_patch.") and name not in _START_UP_MODULES for name in sys.modules)
    for line in environment_warnings(os.environ, requested, in_code):
        sys.stderr.write(WARNING + line + "\n")
    sys.stderr.flush()


def activate() -> None:
    from megatron_lora_patch.runtime import registry

    registry.activate_from_env()


def install() -> None:
    """Entry point of the `.pth` line (some `MEGATRON_*` variable is set); idempotent. Arms the runtime
    when MEGATRON_PLUGINS is set; otherwise only the environment warnings, and only if there is one."""
    global _installed
    requested = bool(os.environ.get(PLUGINS_VARIABLE, "").strip())
    if not requested and not environment_warnings(os.environ, requested):
        return
    _installed = _installed or requested
    if WATCHED_PACKAGE in sys.modules:  # imported before us: not possible from .pth, possible by hand
        warn_environment(requested)
        if requested:
            activate()
    elif not any(isinstance(finder, _MegatronWatcher) for finder in sys.meta_path):
        sys.meta_path.insert(0, _MegatronWatcher(requested))


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
