"""The registry: loads the named plugins, decides which patches are on, and applies each
patch when its target modules are imported (wrapt post-import hooks, so both import
orders work). Knows nothing about LoRA.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import logging
import sys
import threading
import types
from typing import Iterable, Mapping, Optional

import pluggy
import wrapt

from megatron_lora_patch.runtime import errors, flags, hookspecs, versions
from megatron_lora_patch.runtime.errors import UsageError
from megatron_lora_patch.runtime.hookspecs import Settings
from megatron_lora_patch.runtime.outcomes import PatchError, PatchStatus, PluginError, SkipPatch
from megatron_lora_patch.runtime.patching import Change, Patcher, PatchSpec

__all__ = ["PatchError", "PatchStatus", "PluginError", "Settings", "SkipPatch", "apply", "revert", "status"]

logger = logging.getLogger("megatron_lora_patch")

#: Importing it runs the version gate of every enabled patch (all targets live inside it).
VERSION_MODULE = "megatron.core"
#: The distribution that ships this runtime and its own plugins.
DISTRIBUTION = "megatron-lora-patch"


@dataclasses.dataclass
class _Record:
    spec: PatchSpec
    plugin: str
    enabled: bool = False
    source: str = "default"
    state: str = "not configured"  # until an apply() got through validation
    detail: str = ""
    untested: str = ""  # why the version gate was overridden (MEGATRON_LORA_ALLOW_UNTESTED)
    version_checked: bool = False
    patcher: Patcher = dataclasses.field(default_factory=Patcher)
    applied_modules: set = dataclasses.field(default_factory=set)
    unavailable: dict = dataclasses.field(default_factory=dict)  # module -> import error text


class Runtime:
    """Process-wide patch state. Use the module-level `apply`, `revert`, `status`."""

    def __init__(self) -> None:
        self._manager = pluggy.PluginManager(hookspecs.PROJECT)
        self._manager.add_hookspecs(hookspecs)
        self._records: dict[str, _Record] = {}
        self._watched: set[str] = set()
        self._strict = False
        self._allow_untested = False
        self._gated_version: Optional[versions.Version] = None  # what the last version gate judged
        self._warned: set[str] = set()
        self._explicit: dict[str, bool] = {}  # `enable` choices of earlier apply calls (sticky until revert)
        self._lock = threading.RLock()

    # -- public ---------------------------------------------------------------------
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
                self._load_plugin(name)
            self._collect_patches()
            flags.check_variable_names(self._records, self._declared_variables())
            explicit = {**self._explicit, **(enable or {})}
            decisions = flags.resolve_enabled(
                {name: record.spec.default for name, record in self._records.items()}, explicit
            )
            self._strict = flags.strict(strict)
            self._allow_untested = bool(flags.env_bool(flags.ALLOW_UNTESTED_VARIABLE))
            self._manager.hook.megatron_lora_patch_configure(  # plugins validate their own variables
                settings=Settings(
                    plugins=tuple(self._plugin_names()),
                    strict=self._strict,
                    enabled={name: decision[0] for name, decision in decisions.items()},
                )
            )
            self._explicit = explicit
            self._set_enabled(decisions)
            self._watch_targets()
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
                self._revert(record, "reverted")
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
        imported = VERSION_MODULE in sys.modules or self._gated_version is None
        installed = versions.installed_megatron_core() if imported else self._gated_version
        return [
            PatchStatus(
                plugin=record.plugin,
                patch=name,
                target=", ".join(record.patcher.targets()) or record.spec.target_text,
                tested=record.spec.versions,
                installed=str(installed) if installed else "not installed",
                enabled=record.enabled,
                source=record.source,
                state=record.state,
                detail=self._detail(record),
            )
            for name, record in self._records.items()
        ]

    def changes(self, name: str) -> tuple[Change, ...]:
        """The attributes patch `name` changed (and what revert restores), as its patcher recorded them."""
        return self._records[name].patcher.changes

    # -- plugins ----------------------------------------------------------------------
    def _plugin_names(self) -> list[str]:
        return [name for name, _ in self._manager.list_name_plugin()]

    def _load_plugin(self, name: str) -> None:
        if self._manager.has_plugin(name):
            return
        entry_point = _own_plugins().get(name) or installed_plugins().get(name)
        if entry_point is None:
            problem = f"{flags.PLUGINS_VARIABLE} names unknown plugin {name!r}"
            raise PluginError(flags.unknown_name(problem, name, installed_plugins()))
        try:
            plugin = entry_point.load()
        except Exception as error:
            raise PluginError(f"plugin {name!r} failed to load: {type(error).__name__}: {error}") from error
        self._manager.register(plugin, name=name)
        self._manager.check_pending()

    def _collect_patches(self) -> None:
        collected = {record.plugin for record in self._records.values()}
        for hookimpl in self._manager.hook.megatron_lora_patch_patches.get_hookimpls():
            if hookimpl.plugin_name in collected:
                continue
            for spec in hookimpl.function():
                if spec.name in self._records:
                    raise PluginError(
                        f"patch {spec.name!r} is declared by both {self._records[spec.name].plugin!r} "
                        f"and {hookimpl.plugin_name!r}"
                    )
                versions.parse_range(spec.versions, spec.name)  # a bad declaration fails now
                self._records[spec.name] = _Record(spec=spec, plugin=hookimpl.plugin_name)

    def _declared_variables(self) -> set[str]:
        """The MEGATRON_LORA_* variables the loaded plugins read (hook `megatron_lora_patch_env_variables`)."""
        return {name for names in self._manager.hook.megatron_lora_patch_env_variables() for name in names}

    def _set_enabled(self, decisions: Mapping[str, tuple[bool, str]]) -> None:
        for name, (enabled, source) in decisions.items():
            record = self._records[name]
            if record.enabled and not enabled:
                self._revert(record, "disabled")
            record.enabled, record.source = enabled, source
            if not enabled:
                record.state = "disabled"
            elif record.state in ("disabled", "reverted", "not configured"):
                record.state = "not imported yet"

    # -- applying ---------------------------------------------------------------------
    def _watch_targets(self) -> None:
        enabled = [record for record in self._records.values() if record.enabled]
        if enabled:
            self._watch(VERSION_MODULE)  # first: an untested version stops before anything is applied
        for record in enabled:
            for module_name in record.spec.hooks:
                self._watch(module_name)

    def _watch(self, module_name: str) -> None:
        if module_name not in self._watched:
            self._watched.add(module_name)
            # Runs now if the module is already imported, else right after its import; an
            # exception raised here makes that import fail (wrapt `notify_module_loaded`).
            wrapt.register_post_import_hook(self._on_import, module_name)
        elif module_name in sys.modules:
            self._on_import(sys.modules[module_name])

    def _on_import(self, module: types.ModuleType) -> None:
        """Gate and apply every enabled patch that hooks `module`; the first error is raised last."""
        with self._lock:
            first_error: Optional[UsageError] = None
            for record in self._records.values():
                try:
                    if record.enabled and module.__name__ == VERSION_MODULE and record.state == "not imported yet":
                        self._check_version(record)
                    if (
                        record.enabled
                        and module.__name__ in record.spec.hooks
                        and module.__name__ not in record.applied_modules
                        and record.state in ("not imported yet", "applied")
                    ):
                        self._apply_hook(record, module)
                except UsageError as error:
                    first_error = first_error or error
            if first_error is not None:
                raise first_error

    def _check_version(self, record: _Record) -> None:
        """Refuse an enabled patch on a Megatron-Core outside its tested range, unless allowed."""
        if record.version_checked:
            return
        name = record.spec.name
        self._gated_version = versions.installed_megatron_core()
        reason = versions.out_of_range_reason(name, record.spec.versions, self._gated_version)
        if reason and not self._allow_untested:
            record.state, record.detail = "untested", reason
            raise PatchError(
                f"{reason}; set {flags.ALLOW_UNTESTED_VARIABLE}=1 to apply it anyway, "
                f"or {flags.DISABLED_VARIABLE}={name} to train without it"
            )
        if reason:
            record.untested = f"untested: {reason}, applied because {flags.ALLOW_UNTESTED_VARIABLE} is on"
            self.warn_once(f"untested-{name}", record.untested)
        record.version_checked = True

    def _apply_hook(self, record: _Record, module: types.ModuleType) -> None:
        name = record.spec.name
        self._check_version(record)
        try:
            record.spec.hooks[module.__name__](record.patcher, module)
        except SkipPatch as skip:
            self._revert(record, "skipped")
            record.detail = str(skip)
            logger.info("megatron-lora-patch: skipped %s: %s", name, skip)
        except Exception as error:
            self._revert(record, "failed")
            cause = (str(error).strip().splitlines() or [""])[0]
            record.detail = f"{type(error).__name__}: {cause}" if cause else type(error).__name__
            logger.debug("megatron-lora-patch: patch %s failed on %s", name, module.__name__, exc_info=error)
            raise PatchError(
                f"patch {name} failed on {module.__name__}, nothing of it is applied: {record.detail}; "
                f"fix the cause, or set {flags.DISABLED_VARIABLE}={name} to knowingly train without it"
            ) from error
        else:
            record.applied_modules.add(module.__name__)
            record.state, record.detail = "applied", ""
            logger.info("megatron-lora-patch: applied %s to %s", name, module.__name__)

    def _revert(self, record: _Record, state: str) -> None:
        record.patcher.revert()
        record.applied_modules.clear()
        record.state, record.detail = state, ""
        record.untested, record.version_checked = "", False

    @staticmethod
    def _detail(record: _Record) -> str:
        parts = [text for text in (record.detail, record.untested) if text]
        pending = [m for m in record.spec.hooks if m not in record.applied_modules and m not in record.unavailable]
        if record.state == "applied" and pending:
            parts.append("not imported yet: " + ", ".join(pending))
        parts += [f"unavailable: {module} ({error})" for module, error in record.unavailable.items()]
        return "; ".join(parts)


def _own_plugins() -> dict[str, importlib.metadata.EntryPoint]:
    """This distribution's plugins (`lora_correct`, `cpu_testbed`), read from its own metadata only:
    scanning every installed distribution's entry points costs ~10 ms in a large environment, and
    our own names need none of it. Empty when the package runs without its metadata (a bare checkout)."""
    try:
        own = importlib.metadata.distribution(DISTRIBUTION).entry_points
    except importlib.metadata.PackageNotFoundError:
        return {}
    return {ep.name: ep for ep in own if ep.group == hookspecs.ENTRY_POINT_GROUP}


def installed_plugins() -> dict[str, importlib.metadata.EntryPoint]:
    """Entry points of the plugin group by name. Listing them imports nothing."""
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=hookspecs.ENTRY_POINT_GROUP)}


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
