"""The oracle's report: a table for people, a JSON document for machines, one verdict."""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Optional

from megatron_lora_patch.oracle.metrics import PhaseMetrics, worst_ratio
from megatron_lora_patch.oracle.thresholds import PHASES


@dataclasses.dataclass
class TopologyResult:
    topology: str
    world_size: int
    phases: dict  # phase -> PhaseMetrics
    error: Optional[str] = None  # a crashed / hung world: rank id and traceback
    routing: str = ""  # where MoE routing diverged from world-1 (a failure: comparisons are meaningless)
    wall_s: float = 0.0

    @property
    def passed(self) -> bool:
        return self.error is None and not self.routing and all(metrics.passed for metrics in self.phases.values())

    def as_dict(self) -> dict:
        return {
            "topology": self.topology,
            "world_size": self.world_size,
            "passed": self.passed,
            "error": self.error,
            "routing_divergence": self.routing or None,
            "wall_s": round(self.wall_s, 2),
            "phases": {phase: metrics.as_dict() for phase, metrics in self.phases.items()},
        }


@dataclasses.dataclass
class MutationResult:
    name: str
    topology: str
    bug: str
    phases: dict  # phase -> PhaseMetrics of the mutated run against the reference
    error: Optional[str] = None  # a mutation that crashes the run is caught too, but says so
    routing: str = ""  # the mutation also changed MoE routing decisions (caught by that alone)

    @property
    def worst_ratio(self) -> float:
        return worst_ratio(self.phases)

    @property
    def caught(self) -> bool:
        return self.error is not None or bool(self.routing) or any(not m.passed for m in self.phases.values())

    def as_dict(self) -> dict:
        ratio = self.worst_ratio
        return {
            "name": self.name,
            "topology": self.topology,
            "bug": self.bug,
            "worst_metric_over_threshold": None if math.isnan(ratio) else ratio,
            "caught": self.caught,
            "error": self.error,
            "routing_divergence": self.routing or None,
            "phases": {phase: metrics.as_dict() for phase, metrics in self.phases.items()},
        }


@dataclasses.dataclass
class OracleReport:
    settings: dict  # model, dtype, steps, seed, tp_invariant, ...
    topologies: list = dataclasses.field(default_factory=list)
    mutations: list = dataclasses.field(default_factory=list)
    wall_s: float = 0.0

    @property
    def passed(self) -> bool:
        return all(t.passed for t in self.topologies) and all(m.caught for m in self.mutations)

    def verdict(self) -> str:
        failed = [t.topology for t in self.topologies if not t.passed]
        missed = [m.name for m in self.mutations if not m.caught]
        parts = [f"{len(self.topologies) - len(failed)}/{len(self.topologies)} topologies match world-1"]
        if self.mutations:
            parts.append(f"{len(self.mutations) - len(missed)}/{len(self.mutations)} mutations caught")
        text = ", ".join(parts) + f" ({self.wall_s:.0f} s)"
        if failed:
            text += "; FAILED: " + ", ".join(failed)
        if missed:
            text += "; NOT CAUGHT: " + ", ".join(missed)
        return ("PASS: " if self.passed else "FAIL: ") + text

    def as_dict(self) -> dict:
        return {
            "passed": self.passed,
            "verdict": self.verdict(),
            "settings": self.settings,
            "wall_s": round(self.wall_s, 2),
            "topologies": [t.as_dict() for t in self.topologies],
            "mutations": [m.as_dict() for m in self.mutations],
        }

    def write_json(self, path: str) -> None:
        with open(path, "w", encoding="utf-8") as handle:
            json.dump(self.as_dict(), handle, indent=2, allow_nan=True)
            handle.write("\n")

    def table(self) -> str:
        """Topology x phase worst relative L2 (threshold in the header), PASS/FAIL; then mutations."""
        dtype_thresholds = self.settings.get("thresholds", {})
        header = ["topology", "ranks"] + [f"{p} (<={dtype_thresholds.get(p, float('nan')):.0e})" for p in PHASES] + ["result"]
        rows = [header]
        for result in self.topologies:
            cells = [result.topology, str(result.world_size)]
            cells += [_cell(result.phases.get(phase)) for phase in PHASES]
            cells.append("PASS" if result.passed else "FAIL")
            rows.append(cells)
        lines = _aligned(rows)
        for result in self.topologies:
            for problem in (result.error, result.routing):
                if problem:
                    lines.append(f"  {result.topology}: {problem}")
        if self.mutations:
            lines.append("")
            rows = [["mutation", "topology", "worst/threshold", "phase", "result"]]
            for mutation in self.mutations:
                ratio = mutation.worst_ratio
                phase = max(mutation.phases, key=lambda p: mutation.phases[p].ratio) if mutation.phases else "-"
                rows.append(
                    [
                        mutation.name,
                        mutation.topology,
                        "error" if mutation.error else f"{ratio:.3g}",
                        phase if not mutation.error else "-",
                        ("caught" if mutation.caught else "NOT CAUGHT") + (" (routing diverged)" if mutation.routing else ""),
                    ]
                )
            lines += _aligned(rows)
        lines += ["", self.verdict()]
        return "\n".join(lines)


def _cell(metrics: Optional[PhaseMetrics]) -> str:
    if metrics is None:
        return "-"
    return f"{metrics.rel_l2:.2e}" + ("" if metrics.passed else " !")


def _aligned(rows: list) -> list:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
