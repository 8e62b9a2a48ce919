"""Sensitivity mutations: named, toggleable re-introductions of known bugs (DESIGN.md section 8).

A mutation runs only inside the oracle harness. Each names the topology that exposes
it; the oracle must FAIL on that topology with the mutation on, or the harness is broken.

A mutation changes a run in up to four ways, all applied in every rank of the job:
- `install(patcher)`: runs after the oracle turned its patches on and before the model
  is built; every change goes through the `Patcher` (reverted when the job ends). It
  must be a module-level function (jobs are pickled to spawned ranks).
- `settings`: overrides of `testing.driver.TrainSettings` fields.
- `lora`: overrides of `lora.config.LoraConfig` fields.
- `patches`: on/off overrides of `lora_correct` patches (e.g. a patch left out).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Optional

from megatron_lora_patch.patching import Patcher


@dataclasses.dataclass(frozen=True)
class Mutation:
    name: str
    bug: str  # what known bug it re-introduces, and where it was seen
    topology: str  # the topology that exposes it
    model: str = "dense"  # "dense" | "moe"
    install: Optional[Callable[[Patcher], None]] = None
    settings: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    lora: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    patches: Mapping[str, bool] = dataclasses.field(default_factory=dict)


#: Every mutation by name, in the order the oracle runs them.
MUTATIONS: dict[str, Mutation] = {}
