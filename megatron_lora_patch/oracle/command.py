"""`megatron-lora-patch oracle`: every topology's LoRA training step against world-1.

Exit code 0 only if every topology matched and, with --mutations, every mutation was caught.
"""

from __future__ import annotations

import argparse

#: Runs in under 3 minutes on 2 CPU cores: every parallel dimension once, 2 ranks each.
DEFAULT_TOPOLOGIES = ("tp2", "tp2-sp", "dp2", "pp2", "cp2", "ep2", "tp2-etp2-sp")
#: The full matrix, up to 8 ranks: CP, PP, ETP, 4- and 8-rank combinations.
ALL_TOPOLOGIES = DEFAULT_TOPOLOGIES + (
    "tp4",
    "tp4-sp",
    "dp4",
    "pp4",
    "cp4",
    "tp2-dp2",
    "tp2-pp2",
    "tp2-pp2-sp",
    "tp2-cp2",
    "cp2-dp2",
    "pp2-dp2",
    "tp2-pp2-dp2",
    "tp2-pp2-dp2-sp",
    "tp4-dp2-sp",
    "dp4-ep2",
    "ep4",
    "ep2-pp2",
    "tp2-ep2-sp",
    "tp2-ep2-etp2-sp",
    "tp4-ep2-etp2-sp",
    "tp2-ep2-etp2-pp2-sp",
)


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "oracle",
        help="check that every topology's LoRA training step matches world-1 (and that known bugs are caught)",
        description=__doc__,
    )
    parser.add_argument(
        "--topologies",
        default="default",
        help="comma list of topology specs (tp2-sp, dp2, pp2, ep2-dp2, tp2-ep2-etp2-sp, cp2, ...), "
        f"'default' ({','.join(DEFAULT_TOPOLOGIES)}) or 'all' ({len(ALL_TOPOLOGIES)} topologies, up to 8 ranks)",
    )
    parser.add_argument("--mutations", default="none", help="none, all, or a comma list of mutation names")
    parser.add_argument("--steps", type=_positive_int, default=2, help="optimizer steps K (default 2)")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--model", choices=("dense", "moe", "auto"), default="auto",
                        help="auto: the MoE model for topologies with ep/etp, the dense GQA model otherwise")
    parser.add_argument("--json", metavar="PATH", help="write the machine-readable report here")
    parser.add_argument("--plot", metavar="PATH", help="write a PNG heat map of per-layer errors (needs matplotlib)")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--tp-invariant", action="store_true",
                        help="run with the tp_invariant patch; pass only on bitwise-identical results (tp/sp topologies)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per run before a world is killed")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from megatron_lora_patch.oracle.harness import OracleSettings, check_topology, mutations_named, run_oracle
    from megatron_lora_patch.oracle.mutations import MUTATIONS
    from megatron_lora_patch.testing.topology import Topology

    topologies = _select(args.topologies, "--topologies", {"default": DEFAULT_TOPOLOGIES, "all": ALL_TOPOLOGIES})
    mutations = mutations_named(_select(args.mutations, "--mutations", {"none": (), "all": tuple(MUTATIONS)}))
    settings = OracleSettings(
        steps=args.steps, dtype=args.dtype, seed=args.seed, model=args.model,
        tp_invariant=args.tp_invariant, timeout_s=args.timeout,
    )
    for spec in topologies:  # every bad topology fails before anything runs
        check_topology(Topology.parse(spec), settings)
    if args.plot:
        from megatron_lora_patch.oracle import plot  # fails now, not after the run, without matplotlib
    report = run_oracle(topologies, mutations, settings)
    print(report.table())
    if args.json:
        report.write_json(args.json)
    if args.plot:
        plot.heat_map(report, args.plot)
    return 0 if report.passed else 1


def _select(value: str, option: str, named: dict) -> tuple:
    if value in named:
        return tuple(named[value])
    items = tuple(item.strip() for item in value.split(",") if item.strip())
    if not items:
        raise ValueError(f"{option} needs {', '.join(named)} or a comma list; got {value!r}")
    return items


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value
