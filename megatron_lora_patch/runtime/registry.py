"""The registry: the process-wide patch state behind `apply`, `revert` and `status`. It loads the
named plugins (`plugin_set`), decides which patches are on (`flags`), keeps one record per patch
(`records`) and applies each patch when its target modules are imported (`targets`). Knows nothing
about LoRA (docs/architecture.md sections 1-2).
"""

from __future__ import annotations

import importlib
import logging
import sys
import threading
from typing import Iterable, Mapping, Optional

from megatron_lora_patch.runtime import errors, flags, versions
from megatron_lora_patch.runtime.errors import UsageError
from megatron_lora_patch.runtime.hookspecs import Settings
from megatron_lora_patch.runtime.outcomes import PatchError, PatchStatus, PluginError, SkipPatch
from megatron_lora_patch.runtime.patching import Change
from megatron_lora_patch.runtime.plugin_set import PluginSet, installed_plugins
from megatron_lora_patch.runtime.records import PatchRecord, set_enabled
from megatron_lora_patch.runtime.targets import VERSION_MODULE, TargetWatcher

__all__ = [
    "PatchError", "PatchStatus", "PluginError", "Settings", "SkipPatch", "apply", "installed_plugins", "revert",
    "status",
]

logger = logging.getLogger("megatron_lora_patch")


class Runtime:
    """Process-wide patch state. Use the module-level `apply`, `revert`, `status`."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._plugins = PluginSet()
        self._records: dict[str, PatchRecord] = {}
        self._targets = TargetWatcher(self._records, self.warn_once, self._lock)
        self._strict = False
        self._warned: set[str] = set()
        self._explicit: dict[str, bool] = {}  # `enable` choices of earlier apply calls (sticky until revert)

    def apply(
        self,
        plugins: Optional[Iterable[str]] = None,
        enable: Optional[Mapping[str, bool]] = None,
        strict: Optional[bool] = None,
    ) -> list[PatchStatus]:
        """Load plugins (argument, else MEGATRON_PLUGINS), validate every flag (a `UsageError`
        before anything changes), apply what is on (`PatchError` when a patch fails or meets an
        untested Megatron-Core). Idempotent; `enable` choices stick until `revert`."""
        with self._lock:
            names = list(plugins) if plugins is not None else flags.requested_plugins()
            if not names:
                raise flags.FlagError(
                    f"no plugin requested: set {flags.PLUGINS_VARIABLE}=lora_correct or pass plugins=['lora_correct']"
                )
            flags.check_booleans()
            for name in names:
                self._plugins.load(name)
            self._plugins.collect_patches(self._records)
            flags.check_variable_names(self._records, self._plugins.declared_variables())
            explicit = {**self._explicit, **(enable or {})}
            decisions = flags.resolve_enabled(
                {name: record.spec.default for name, record in self._records.items()}, explicit
            )
            self._strict = flags.strict(strict)
            self._targets.allow_untested = bool(flags.env_bool(flags.ALLOW_UNTESTED_VARIABLE))
            self._plugins.configure(
                Settings(
                    plugins=tuple(self._plugins.names()),
                    strict=self._strict,
                    enabled={name: decision[0] for name, decision in decisions.items()},
                )
            )
            self._explicit = explicit
            set_enabled(self._records, decisions)
            self._targets.watch_enabled()
            return self.status()

    def revert(self, names: Optional[Iterable[str]] = None) -> list[PatchStatus]:
        """Restore the originals of the named patches (all when None)."""
        with self._lock:
            selected = list(self._records) if names is None else list(names)
            for name in selected:
                if name not in self._records:
                    raise flags.FlagError(
                        f"cannot revert unknown patch {name!r}; known patches: {', '.join(sorted(self._records))}"
                    )
                record = self._records[name]
                record.revert("reverted")
                record.enabled = False
                self._explicit.pop(name, None)
            self._warned.clear()  # a re-applied patch reports its problems again
            return self.status()

    @property
    def strict(self) -> bool:
        return self._strict

    def warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning("megatron-lora-patch: %s", message)

    def import_targets(self) -> Optional[UsageError]:
        """Import every enabled patch's target modules (what `status` does to show real states);
        stop at the first patch that cannot be delivered (Python undoes that failed import) and return its error."""
        for record in list(self._records.values()):
            if not record.enabled:
                continue
            for module_name in record.spec.hooks:
                try:
                    importlib.import_module(module_name)
                except UsageError as error:
                    return error
                except ImportError as error:
                    record.unavailable[module_name] = str(error)
        return None

    def status(self) -> list[PatchStatus]:
        # A failed import is undone, so the version a gate judged is what that import would run.
        imported = VERSION_MODULE in sys.modules or self._targets.gated_version is None
        installed = versions.installed_megatron_core() if imported else self._targets.gated_version
        return [record.status(installed) for record in self._records.values()]

    def changes(self, name: str) -> tuple[Change, ...]:
        """The attributes patch `name` changed (and what revert restores), as its patcher recorded them."""
        return self._records[name].patcher.changes


_runtime: Optional[Runtime] = None
_runtime_lock = threading.Lock()


def get_runtime() -> Runtime:
    global _runtime
    with _runtime_lock:
        if _runtime is None:
            _runtime = Runtime()
        return _runtime


def apply(
    plugins: Optional[Iterable[str]] = None,
    enable: Optional[Mapping[str, bool]] = None,
    strict: Optional[bool] = None,
) -> list[PatchStatus]:
    """Apply the patches of `plugins` (default: MEGATRON_PLUGINS). `enable` forces patches
    on/off by name and beats the environment, which beats each patch's default."""
    return get_runtime().apply(plugins, enable, strict)


def revert(names: Optional[Iterable[str]] = None) -> list[PatchStatus]:
    """Restore the exact originals of the named patches (all when None)."""
    return get_runtime().revert(names)


def status() -> list[PatchStatus]:
    """One row per known patch: enabled and why, applied / skipped / failed and why."""
    return get_runtime().status()


def strict() -> bool:
    """Whether problems raise: as resolved by the last `apply` (argument > MEGATRON_LORA_STRICT)."""
    return get_runtime().strict


def report_problem(key: str, message: str, fallback: str = "") -> None:
    """A patch found a misuse at run time (not at patch time): raise `PatchError` in strict
    mode, else warn once per `key` (with `fallback` saying what the run does instead)."""
    if strict():
        raise PatchError(f"{message} (MEGATRON_LORA_STRICT is on)")
    get_runtime().warn_once(key, message + fallback)


def warn_once(key: str, message: str) -> None:
    """A warning that never needs to stop the run, logged once per `key`."""
    get_runtime().warn_once(key, message)


def activate_from_env() -> None:
    """Called by the start-up bootstrap on the first `import megatron`: a `UsageError` from
    here (or from a patch hook later) ends the process with one line, no traceback."""
    errors.install_excepthook()
    get_runtime().apply()
