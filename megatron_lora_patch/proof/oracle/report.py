"""The oracle's report: a table for people, a JSON document for machines, one verdict."""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Optional

from megatron_lora_patch.proof.oracle.metrics import PhaseMetrics, worst_ratio
from megatron_lora_patch.proof.oracle.thresholds import PHASES


@dataclasses.dataclass
class TopologyResult:
    topology: str
    world_size: int
    phases: dict  # phase -> PhaseMetrics
    error: Optional[str] = None  # a crashed / hung world: rank id and traceback
    routing: str = ""  # where MoE routing diverged from world-1 (a failure: comparisons are meaningless)
    wall_s: float = 0.0  # the run's seconds in its ranks (world setup + training; shared imports not counted)
    model: str = ""  # dense | moe | hybrid
    note: str = ""  # shown, never failing (bf16: a routing flip from rounding)

    @property
    def passed(self) -> bool:
        return self.error is None and not self.routing and all(metrics.passed for metrics in self.phases.values())

    def as_dict(self) -> dict:
        return {
            "topology": self.topology,
            "world_size": self.world_size,
            "model": self.model,
            "passed": self.passed,
            "error": self.error,
            "routing_divergence": self.routing or None,
            "note": self.note or None,
            "wall_s": round(self.wall_s, 2),
            "phases": {phase: metrics.as_dict() for phase, metrics in self.phases.items()},
        }


@dataclasses.dataclass
class MutationResult:
    name: str
    topology: str
    bug: str
    phases: dict  # phase -> PhaseMetrics of the mutated run against the reference
    error: Optional[str] = None  # the mutated run crashed or hung: ERRORED, neither caught nor missed
    routing: str = ""  # the mutation also changed MoE routing decisions (caught by that alone)
    note: str = ""  # shown, never counting as caught (bf16: a routing flip from rounding)

    @property
    def worst_ratio(self) -> float:
        return worst_ratio(self.phases)

    @property
    def errored(self) -> bool:
        """The run broke, so nothing shows the oracle would see this bug (a renamed Megatron
        attribute must not turn `--mutations all` into "all caught")."""
        return self.error is not None

    @property
    def caught(self) -> bool:
        return not self.errored and (bool(self.routing) or any(not m.passed for m in self.phases.values()))

    @property
    def outcome(self) -> str:
        return "errored" if self.errored else "caught" if self.caught else "not caught"

    def as_dict(self) -> dict:
        ratio = self.worst_ratio
        return {
            "name": self.name,
            "topology": self.topology,
            "bug": self.bug,
            "worst_metric_over_threshold": None if math.isnan(ratio) else ratio,
            "caught": self.caught,
            "outcome": self.outcome,
            "error": self.error,
            "routing_divergence": self.routing or None,
            "note": self.note or None,
            "phases": {phase: metrics.as_dict() for phase, metrics in self.phases.items()},
        }


#: Lines of a rank traceback the table shows (the JSON keeps all of it).
TRACEBACK_TAIL = 12


@dataclasses.dataclass
class OracleReport:
    settings: dict  # model, dtype, steps, seed, layout_invariant, ...
    topologies: list = dataclasses.field(default_factory=list)
    mutations: list = dataclasses.field(default_factory=list)
    wall_s: float = 0.0
    reference_error: Optional[str] = None  # a world-1 reference run failed: nothing was compared

    @property
    def passed(self) -> bool:
        return (
            self.reference_error is None
            and all(t.passed for t in self.topologies)
            and all(m.caught for m in self.mutations)
        )

    def verdict(self) -> str:
        if self.reference_error is not None:
            return (
                f"FAIL: {self.reference_error.splitlines()[0].rstrip(':')}, "
                f"so nothing was compared ({self.wall_s:.0f} s)"
            )
        failed = [t.topology for t in self.topologies if not t.passed]
        missed = [m.name for m in self.mutations if m.outcome == "not caught"]
        errored = [m.name for m in self.mutations if m.errored]
        parts = [f"{len(self.topologies) - len(failed)}/{len(self.topologies)} topologies match world-1"]
        if self.mutations:
            parts.append(f"{sum(m.caught for m in self.mutations)}/{len(self.mutations)} mutations caught")
        text = ", ".join(parts) + f" ({self.wall_s:.0f} s)"
        for label, names in (("FAILED", failed), ("NOT CAUGHT", missed), ("ERRORED (the run broke)", errored)):
            if names:
                text += f"; {label}: " + ", ".join(names)
        return ("PASS: " if self.passed else "FAIL: ") + text

    def as_dict(self) -> dict:
        return {
            "passed": self.passed,
            "verdict": self.verdict(),
            "settings": self.settings,
            "wall_s": round(self.wall_s, 2),
            "reference_error": self.reference_error,
            "topologies": [t.as_dict() for t in self.topologies],
            "mutations": [m.as_dict() for m in self.mutations],
        }

    def write_json(self, path: str) -> None:
        with open(path, "w", encoding="utf-8") as handle:
            json.dump(self.as_dict(), handle, indent=2, allow_nan=True)
            handle.write("\n")

    def table(self) -> str:
        """What a person reads: a title (metric, dtype, steps, models), topology x phase worst
        relative error with the thresholds, the mutations, then the verdict. A failed reference
        run is only its traceback's tail and the verdict."""
        if self.reference_error is not None:
            return "\n".join([_tail(self.reference_error.split("\n", 1)[-1]), "", self.verdict()])
        lines = self._title() + _aligned(self._topology_rows())
        for result in self.topologies:
            for problem in (result.error, result.routing, result.note and f"note: {result.note}"):
                if problem and "\n" not in problem.strip():
                    lines.append(f"  {result.topology}: {problem.strip()}")
                elif problem:
                    lines += [f"  {result.topology}:", _tail(problem)]
        if self.mutations:
            lines += [""] + _aligned(self._mutation_rows())
            for mutation in self.mutations:
                if mutation.errored:
                    lines += [f"  {mutation.name} on {mutation.topology} ERRORED:", _tail(mutation.error)]
                if mutation.note:
                    lines.append(f"  {mutation.name}: note: {mutation.note}")
        lines += ["", self.verdict()]
        return "\n".join(lines)

    def _title(self) -> list:
        settings = self.settings
        used = sorted({t.model for t in self.topologies if t.model})
        summaries = settings.get("model_summaries", {})
        models = "; ".join(f"{name}: {summaries.get(name, name)}" for name in used)
        return [
            "relative L2 error vs world-1, ||run - world1|| / ||world1||, of the worst tensor of each phase "
            "(thresholds: step 0 / later steps; '-': not compared)",
            f"dtype {settings.get('dtype', '?')}, {settings.get('steps', '?')} steps, seed {settings.get('seed', '?')}"
            + (f"; models {models}" if models else ""),
            "",
        ]

    def _topology_rows(self) -> list:
        limits = self.settings.get("thresholds", {})
        header = ["topology", "ranks", "model"] + [_threshold_header(p, limits.get(p, {})) for p in PHASES]
        rows = [header + ["wall s", "result"]]
        for result in self.topologies:
            cells = [result.topology, str(result.world_size), result.model or "-"]
            cells += [_cell(result.phases.get(phase)) for phase in PHASES]
            rows.append(cells + [f"{result.wall_s:.1f}", "PASS" if result.passed else "FAIL"])
        return rows

    def _mutation_rows(self) -> list:
        rows = [["mutation", "topology", "worst/threshold", "phase", "result"]]
        for mutation in self.mutations:
            phase = max(mutation.phases, key=lambda p: mutation.phases[p].ratio) if mutation.phases else "-"
            ratio = "-" if mutation.errored else f"{mutation.worst_ratio:.3g}"
            result = mutation.outcome.upper() if mutation.outcome != "caught" else "caught"
            rows.append(
                [
                    mutation.name,
                    mutation.topology,
                    ratio,
                    phase,
                    result + (" (routing diverged)" if mutation.routing else ""),
                ]
            )
        return rows


def _threshold_header(phase: str, limits: dict) -> str:
    pair = [limits.get("step 0"), limits.get("later steps")]
    if phase == "forward":  # step 0 only
        pair = pair[:1]
    return f"{phase} (<={'/'.join('-' if value is None else f'{value:.0e}' for value in pair)})"


def _tail(text: str, lines: int = TRACEBACK_TAIL) -> str:
    """The first line of a world's error (which ranks failed) and the last `lines` of the traceback."""
    all_lines = text.rstrip().splitlines()
    if len(all_lines) <= lines + 1:
        return "\n".join("  " + line for line in all_lines)
    kept = [all_lines[0], f"  ... ({len(all_lines) - lines - 1} lines; the full traceback is in --json)"] + all_lines[
        -lines:
    ]
    return "\n".join("  " + line for line in kept)


def _cell(metrics: Optional[PhaseMetrics]) -> str:
    if metrics is None:
        return "-"
    return f"{metrics.rel_l2:.2e}" + ("" if metrics.passed else " !")


def _aligned(rows: list) -> list:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
