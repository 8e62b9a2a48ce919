"""`--plot PATH`: a PNG heat map of the oracle's per-layer errors (matplotlib, optional extra `plot`).

Rows: topologies, then mutations (below a rule); columns: phase x layer. Colour: log10 of the
per-layer mean relative L2 error over the phase's threshold, so 0 (white) is the pass line,
blue passed and red failed: a caught mutation is a red row.
"""

from __future__ import annotations

import math

from megatron_lora_patch.proof.oracle.report import OracleReport
from megatron_lora_patch.proof.oracle.thresholds import PHASES

try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
except ImportError as error:  # raised when --plot is parsed, before anything runs
    raise ImportError(
        "--plot needs matplotlib: pip install 'megatron-lora-patch[plot]' (or pip install matplotlib)"
    ) from error


def heat_map(report: OracleReport, path: str) -> None:
    rows = [(t.topology, t.phases) for t in report.topologies]
    rows += [(f"{m.name} @ {m.topology}", m.phases) for m in report.mutations]
    columns = sorted(
        {(phase, layer) for _, phases in rows for phase, metrics in phases.items() for layer in metrics.per_layer},
        key=lambda c: (PHASES.index(c[0]), c[1]),
    )
    values = [[_log_ratio(phases, phase, layer) for phase, layer in columns] for _, phases in rows]
    figure, axes = plt.subplots(figsize=(max(6.0, 0.35 * len(columns) + 3), max(2.5, 0.3 * len(rows) + 1.5)))
    image = axes.imshow(values, cmap="coolwarm", vmin=-6, vmax=6, aspect="auto")
    axes.set_yticks(range(len(rows)), [label for label, _ in rows], fontsize=7)
    axes.set_xticks(range(len(columns)), [f"{phase}:{layer}" for phase, layer in columns], rotation=90, fontsize=6)
    if report.mutations and report.topologies:
        axes.axhline(len(report.topologies) - 0.5, color="black", linewidth=1)
    figure.colorbar(image, ax=axes, label="log10(relative L2 / threshold)")
    axes.set_title(report.verdict(), fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def _log_ratio(phases: dict, phase: str, layer: str) -> float:
    metrics = phases.get(phase)
    if metrics is None or layer not in metrics.per_layer:
        return math.nan
    threshold = metrics.threshold or 1e-12  # the layout-invariant thresholds are exactly 0
    return math.log10(max(metrics.per_layer[layer], 1e-30) / threshold)
