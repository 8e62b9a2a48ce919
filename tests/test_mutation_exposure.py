"""Each mutation's declared exposure (`Mutation.exposed_by` / `unsupported`) is what the oracle measures.

The preflight refuses a mutation on a topology none of whose `exposed_by` conditions hold, because there the
mutated run equals the reference and could only pass (proof/oracle/exposure.py). Both directions are run, in one
`run_oracle` call:
- a *witness* for each declared condition the mutation's own topology does not already hold (its own topology is
  `test_oracle_mutations`'): a two-rank topology where it holds must catch the bug (else the declaration is too
  broad, and the preflight would let a vacuous run pass);
- a *neighbour* where none holds must not (else too narrow: the preflight would refuse a run that catches it); one
  neighbour each, the first of `CANDIDATES` (the whole matrix is `benchmarks/mutation_exposure.py`'s, 12 minutes):
  a narrowness this misses errs to a refusal, never to a vacuous pass;
- a mutation that names no condition must be caught at world size 1 (the GPU preflight's one-rank run) and at
  TP 2 (+ SP where it runs).
"""

from __future__ import annotations

import dataclasses

import pytest

from megatron_lora_patch.proof.oracle import exposure, harness
from megatron_lora_patch.proof.oracle.mutations import MUTATIONS
from megatron_lora_patch.proof.oracle.settings import OracleError
from megatron_lora_patch.proof.testbed.topology import Topology, TopologyError

#: The topologies tried, two-rank ones first (the testbed's MoE tp2 keeps etp1: an expert-DP group of its own).
CANDIDATES = ("dp2", "tp2", "pp2", "cp2", "tp2-sp", "ep2", "ep2-etp2", "tp1")
MIN_RATIO = 100.0  # as test_oracle_mutations: a caught bug clears its threshold by 100x
MAX_UNCHANGED_RATIO = 1.0  # a neighbour's mutated run stays within every threshold (measured: 0.13x at most)


def _runs_on(mutation, spec: str) -> bool:
    """The oracle can run `mutation` on `spec` (its model and data fit; nothing its code does not model)."""
    settings = harness.mutation_settings(
        harness.OracleSettings(model=mutation.model, data=mutation.data or "unpacked"), mutation
    )
    try:
        harness.check_topology(Topology.parse(spec), settings)
    except (OracleError, TopologyError):
        return False
    return not any(_holds(name, spec) for name in mutation.unsupported)


def _holds(name: str, spec: str) -> bool:
    return exposure.CONDITIONS[name].holds(Topology.parse(spec))


def _cases() -> dict:
    """{variant name: (mutation on its topology, must be caught)}."""
    cases = {}
    for mutation in MUTATIONS.values():
        runnable = [spec for spec in CANDIDATES if _runs_on(mutation, spec)]
        if not mutation.exposed_by:  # every world: one rank, and the most sharded two-rank layout it runs on
            for spec in ("tp1", next(spec for spec in ("tp2-sp", "tp2") if spec in runnable)):
                cases[f"{mutation.name}@{spec}"] = (dataclasses.replace(mutation, topology=spec), True)
            continue
        for name in mutation.exposed_by:
            if not _holds(name, mutation.topology):
                spec = next(spec for spec in runnable if _holds(name, spec))
                cases[f"{mutation.name}@{spec}"] = (dataclasses.replace(mutation, topology=spec), True)
        spec = next(spec for spec in runnable if exposure.refusal(mutation, Topology.parse(spec)))
        cases[f"{mutation.name}@{spec}"] = (dataclasses.replace(mutation, topology=spec), False)
    return {name: (dataclasses.replace(mutation, name=name), caught) for name, (mutation, caught) in cases.items()}


CASES = _cases()


def test_every_condition_is_known_and_every_mutation_runs_where_it_is_exposed():
    for name, mutation in MUTATIONS.items():
        named = mutation.exposed_by + mutation.unsupported
        assert set(named) <= set(exposure.CONDITIONS), f"{name}: unknown condition in {named}"
        assert all(exposure.CONDITIONS[c].off for c in mutation.unsupported), f"{name}: an unsupported one lacks off"
        assert exposure.refusal(mutation, Topology.parse(mutation.topology)) is None, name


@pytest.fixture(scope="module")
def report():
    result = harness.run_oracle([], [mutation for mutation, _ in CASES.values()], harness.OracleSettings())
    print(result.table())
    assert result.reference_error is None, result.reference_error
    return {row.name: row for row in result.mutations}


@pytest.mark.parametrize("name", CASES)
def test_the_declared_exposure_is_measured(report, name):
    row, must_catch = report[name], CASES[name][1]
    assert row.error is None, f"{name} crashed the run:\n{row.error}"
    if must_catch:
        assert row.caught and row.worst_ratio >= MIN_RATIO, f"{name}: declared exposed, measured {row.worst_ratio:.3g}x"
    else:
        assert row.worst_ratio < MAX_UNCHANGED_RATIO, f"{name}: declared unexposed, measured {row.worst_ratio:.3g}x"
