"""Before a hand-off moves anything, every rank agrees on the call: same function, `dst` and family, all present.

`adapter_state` / `stream` are collective. Ranks that pass different `dst` (each would wait for sends meant
for another rank), or a rank that never calls, would block every other rank in the metadata exchange until
the process group's timeout (10 to 30 minutes), with nothing naming the cause. `agree` runs the runtime's
store-based agreement (`runtime.agreement`: no collective, a bounded wait) over the world first; the n-th hand-off
call of each rank, whichever function it is, is one collective call. docs/handoff.md section 1.
"""

from __future__ import annotations

from typing import Optional

from megatron_lora_patch.runtime import agreement
from megatron_lora_patch.runtime.agreement import DEFAULT_TIMEOUT_S  # noqa: F401  (handoff's default timeout)


class HandoffCallError(agreement.CallAgreementError):
    """The ranks did not make the same hand-off call (different arguments, or a rank absent); one line."""


def agree(call: str, dst: int, family: Optional[str], timeout: float) -> None:
    """Return once every rank made this same call (`call`, `dst`, `family`); else a one-line `HandoffCallError`
    on each rank (every rank present: the same line on all). World size 1 or no process group: nothing to agree."""

    def fix(field: str) -> str:
        if field == "call":
            return "call the same hand-off function (handoff.adapter_state or handoff.stream)"
        return f"pass the same {field} to handoff.{call}"

    fields = {"call": call, "dst": dst, "family": family}
    agreement.agree(
        agreement.Call(f"handoff.{call}", "handoff", fields, fix, error=HandoffCallError), timeout
    )
