"""Rank-side loop of the fail-closed tests of collective calls (hand-off, adapter I/O, DoRA merge): each rank builds
the model with adapters, then makes its own calls in order, so the parent can give the ranks different calls."""

from __future__ import annotations

import time
from typing import Callable, Optional, Sequence

import persistence_worker


def make_calls(rank: int, topology: str, spec, config, calls: dict, perform: Callable[[list, tuple], str],
               prepare: Optional[Callable[[tuple], None]] = None) -> list:
    """The model with adapters of `config` on `topology`, then this rank's `calls[rank]`, each a tuple or None (a
    call this rank skips). Per call (outcome, seconds): what `perform(chunks, call)` returned, or the message of the
    UsageError it raised; `prepare(call)` runs first, outside the clock (a delay)."""
    from megatron_lora_patch.proof.testbed.models import build_model
    from megatron_lora_patch.proof.testbed.topology import Topology
    from megatron_lora_patch.runtime.errors import UsageError

    persistence_worker.setup(config)
    parsed = Topology.parse(topology)
    outcomes = []
    with parsed.world():
        chunks = build_model(spec, parsed)
        mine: Sequence[Optional[tuple]] = calls[rank]
        for call in mine:
            if call is None:
                outcomes.append(("skipped", 0.0))
                continue
            if prepare is not None:
                prepare(call)
            start = time.monotonic()
            try:
                outcome = perform(chunks, call)
            except UsageError as error:
                outcome = str(error)
            outcomes.append((outcome, time.monotonic() - start))
    return outcomes
