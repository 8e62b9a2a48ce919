"""One record per declared patch: whether it is on and why, what state it is in, and what its patcher
changed (docs/architecture.md section 1, steps 3-5). Pure bookkeeping: nothing here imports a target."""

from __future__ import annotations

import dataclasses
from typing import Mapping, Optional

from megatron_lora_patch.runtime import versions
from megatron_lora_patch.runtime.outcomes import PatchStatus
from megatron_lora_patch.runtime.patching import Patcher, PatchSpec


@dataclasses.dataclass
class PatchRecord:
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
    unavailable: dict = dataclasses.field(default_factory=dict)  # optional target module -> import error text

    def revert(self, state: str) -> None:
        """Put back every original the patch changed and enter `state`."""
        self.patcher.revert()
        self.applied_modules.clear()
        self.state, self.detail = state, ""
        self.untested, self.version_checked = "", False

    def set_enabled(self, enabled: bool, source: str) -> None:
        """Turn the patch on or off (off reverts what it applied); `source` says who decided."""
        if self.enabled and not enabled:
            self.revert("disabled")
        self.enabled, self.source = enabled, source
        if not enabled:
            self.state = "disabled"
        elif self.state in ("disabled", "reverted", "not configured"):
            self.state = "not imported yet"

    def details(self) -> str:
        parts = [text for text in (self.detail, self.untested) if text]
        pending = [m for m in self.spec.hooks if m not in self.applied_modules and m not in self.unavailable]
        if self.state == "applied" and pending:
            parts.append("not imported yet: " + ", ".join(pending))
        return "; ".join(parts)

    def status(self, installed: Optional[versions.Version]) -> PatchStatus:
        return PatchStatus(
            plugin=self.plugin,
            patch=self.spec.name,
            target=", ".join(self.patcher.targets()) or self.spec.target_text,
            tested=self.spec.versions,
            installed=str(installed) if installed else "not installed",
            enabled=self.enabled,
            source=self.source,
            state=self.state,
            detail=self.details(),
            absent=tuple(f"{module} ({error})" for module, error in self.unavailable.items()),
        )


def set_enabled(records: Mapping[str, PatchRecord], decisions: Mapping[str, tuple[bool, str]]) -> None:
    for name, (enabled, source) in decisions.items():
        records[name].set_enabled(enabled, source)
