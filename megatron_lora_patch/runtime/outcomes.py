"""What applying a patch can end in: the exceptions a hook or the registry raises, and the
status row `megatron-lora-patch status` prints. Re-exported by `runtime`."""

from __future__ import annotations

import dataclasses

from megatron_lora_patch.runtime.errors import UsageError


class SkipPatch(Exception):
    """Raised by a hook when its patch does not apply here (already upstream, no CPU
    needed, ...). Whatever the patch changed so far is reverted; status shows the reason."""


class PatchError(UsageError, RuntimeError):
    """An enabled patch cannot be delivered (it failed to apply, the Megatron-Core version is
    untested, or a run-time misuse in strict mode): the run stops with this one line."""


class PluginError(UsageError, LookupError):
    """A requested plugin is not installed or does not load."""


@dataclasses.dataclass(frozen=True)
class PatchStatus:
    """One row of `megatron-lora-patch status`."""

    plugin: str
    patch: str
    target: str
    tested: str
    installed: str
    enabled: bool
    source: str  # where `enabled` came from: arg, env or default
    state: str  # applied, skipped, failed, untested, disabled, reverted, not imported yet, not configured
    detail: str = ""
    absent: tuple = ()  # optional target modules that do not import here, each "module (import error)"

    def state_text(self) -> str:
        """The state as `status` prints it: "applied (2 optional targets absent: ...)", then any detail."""
        text = self.state
        if self.absent:
            count = len(self.absent)
            text += f" ({count} optional target{'s' if count > 1 else ''} absent: {', '.join(self.absent)})"
        return text + (f": {self.detail}" if self.detail else "")

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)
