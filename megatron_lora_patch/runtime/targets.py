"""Applying patches where their targets are: one wrapt post-import hook per target module (so both
import orders work), the version gate on `megatron.core`, and each hook run with its patch's `Patcher`
(a failure reverts the whole patch and stops the import with one line; docs/architecture.md section 1,
steps 4-5)."""

from __future__ import annotations

import logging
import sys
import threading
import types
from typing import Callable, Mapping, Optional

import wrapt

from megatron_lora_patch.runtime import flags, versions
from megatron_lora_patch.runtime.errors import UsageError
from megatron_lora_patch.runtime.outcomes import PatchError, SkipPatch
from megatron_lora_patch.runtime.records import PatchRecord

logger = logging.getLogger("megatron_lora_patch")

#: Importing it runs the version gate of every enabled patch (all targets live inside it).
VERSION_MODULE = "megatron.core"


class TargetWatcher:
    """Watches the target modules of the enabled patches and applies each patch as they are imported."""

    def __init__(
        self, records: Mapping[str, PatchRecord], warn_once: Callable[[str, str], None], lock: threading.RLock
    ) -> None:
        self._records = records
        self._warn_once = warn_once
        self._lock = lock
        self._watched: set[str] = set()
        self.allow_untested = False
        self.gated_version: Optional[versions.Version] = None  # what the last version gate judged

    def watch_enabled(self) -> None:
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
            wrapt.register_post_import_hook(self.on_import, module_name)
        elif module_name in sys.modules:
            self.on_import(sys.modules[module_name])

    def on_import(self, module: types.ModuleType) -> None:
        """Gate and apply every enabled patch that hooks `module`; the first error is raised last."""
        with self._lock:
            self._apply_all(module)

    def _apply_all(self, module: types.ModuleType) -> None:
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

    def _check_version(self, record: PatchRecord) -> None:
        """Refuse an enabled patch on a Megatron-Core outside its tested range, unless allowed."""
        if record.version_checked:
            return
        name = record.spec.name
        self.gated_version = versions.installed_megatron_core()
        reason = versions.out_of_range_reason(name, record.spec.versions, self.gated_version)
        if reason and not self.allow_untested:
            record.state, record.detail = "untested", reason
            raise PatchError(
                f"{reason}; set {flags.ALLOW_UNTESTED_VARIABLE}=1 to apply it anyway, "
                f"or {flags.DISABLED_VARIABLE}={name} to train without it"
            )
        if reason:
            record.untested = f"untested: {reason}, applied because {flags.ALLOW_UNTESTED_VARIABLE} is on"
            self._warn_once(f"untested-{name}", record.untested)
        record.version_checked = True

    def _apply_hook(self, record: PatchRecord, module: types.ModuleType) -> None:
        name = record.spec.name
        self._check_version(record)
        try:
            record.spec.hooks[module.__name__](record.patcher, module)
        except SkipPatch as skip:
            record.revert("skipped")
            record.detail = str(skip)
            logger.info("megatron-lora-patch: skipped %s: %s", name, skip)
        except Exception as error:
            record.revert("failed")
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
