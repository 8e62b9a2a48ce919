"""Which topologies expose each mutation: every mutation on every single-axis topology, in one oracle call.

Prints, per mutation and topology, the worst phase's ratio to its threshold (`*`: caught; `ERR`: the mutation's
code cannot run there; `-`: the topology does not fit its model or data) and each mutation's declared
`exposed_by` / `unsupported` (proof/oracle/exposure.py), from which docs/preflight.md's "Mutations" table is read.
About 12 minutes on 2 CPU cores for the default 30 mutations x 8 topologies.

    nice -n 15 python -P benchmarks/mutation_exposure.py [--topologies tp1,dp2,...] [--mutations NAME,...]
"""

from __future__ import annotations

import argparse
import dataclasses

from megatron_lora_patch.proof.oracle import harness
from megatron_lora_patch.proof.oracle.mutations import MUTATIONS
from megatron_lora_patch.proof.oracle.settings import OracleError
from megatron_lora_patch.proof.testbed.topology import Topology, TopologyError

TOPOLOGIES = "tp1,dp2,tp2,tp2-sp,pp2,cp2,ep2,ep2-etp2"


def _variants(names, specs) -> list:
    """Every mutation on every topology that fits its model and data, named NAME@TOPOLOGY."""
    variants = []
    for name in names:
        mutation = MUTATIONS[name]
        settings = harness.mutation_settings(
            harness.OracleSettings(model=mutation.model, data=mutation.data or "unpacked"), mutation
        )
        for spec in specs:
            try:
                harness.check_topology(Topology.parse(spec), settings)
            except (OracleError, TopologyError):
                continue
            variants.append(dataclasses.replace(mutation, topology=spec, name=f"{name}@{spec}"))
    return variants


def _cell(row) -> str:
    if row is None:
        return "-"
    if row.error:
        return "ERR"
    return f"{row.worst_ratio:.2g}" + ("*" if row.caught else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--topologies", default=TOPOLOGIES)
    parser.add_argument("--mutations", default=",".join(MUTATIONS))
    options = parser.parse_args()
    names, specs = options.mutations.split(","), options.topologies.split(",")
    unknown = [name for name in names if name not in MUTATIONS]
    if unknown:
        parser.error(f"unknown mutation {unknown[0]!r}; known: {', '.join(MUTATIONS)}")
    report = harness.run_oracle([], _variants(names, specs), harness.OracleSettings())
    if report.reference_error:
        raise SystemExit(report.reference_error)
    rows = {row.name: row for row in report.mutations}
    print(f"{'mutation':40}" + "".join(f"{spec:>10}" for spec in specs) + "  exposed_by / unsupported")
    for name in names:
        cells = "".join(f"{_cell(rows.get(f'{name}@{spec}')):>10}" for spec in specs)
        mutation = MUTATIONS[name]
        declared = ",".join(mutation.exposed_by) or "(any world)"
        unsupported = f" / {','.join(mutation.unsupported)}" if mutation.unsupported else ""
        print(f"{name:40}{cells}  {declared}{unsupported}")
    print(f"({report.wall_s:.0f} s)")


if __name__ == "__main__":
    main()
