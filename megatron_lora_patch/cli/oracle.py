"""`megatron-lora-patch oracle`: every topology's LoRA training step against world-1.

Exit code 0 only if every topology matched and, with --mutations, every mutation was caught.
"""

from __future__ import annotations

import argparse
import sys

from megatron_lora_patch.cli import checks

#: Runs in under 3 minutes on 2 CPU cores: every parallel dimension once, 2 ranks each.
DEFAULT_TOPOLOGIES = ("tp2", "tp2-sp", "dp2", "pp2", "cp2", "ep2", "tp2-etp2-sp")
#: `--layout-invariant`'s default: 16 dense layouts of tp {1, 2, 4} x dp {1, 2, 4} x pp {1, 2}, with and without
#: sp, up to 8 ranks, and 12 MoE layouts of ep {1, 2, 4} x etp {1, 2} with dp, pp and tp (2 to 8 ranks)
#: (docs/architecture.md section 7).
LAYOUT_TOPOLOGIES = (
    "tp2",
    "tp2-sp",
    "dp2",
    "pp2",
    "tp4",
    "tp4-sp",
    "dp4",
    "tp2-dp2",
    "tp2-dp2-sp",
    "tp2-pp2",
    "tp2-pp2-sp",
    "pp2-dp2",
    "tp2-pp2-dp2",
    "tp2-pp2-dp2-sp",
    "tp2-dp4",
    "tp4-dp2-sp",
    "ep2",
    "ep4",
    "dp4-ep2",
    "pp2-ep2",
    "ep2-etp2",
    "ep4-etp2",
    "dp8-ep2-etp2",
    "pp2-ep2-etp2",
    "tp2-ep2-sp",
    "tp2-etp2-sp",
    "tp2-ep2-etp2-sp",
    "tp4-ep4-sp",
)
#: `--layout-invariant`'s global batch: two microbatches in each of the 8 lanes of its reduction tree.
LAYOUT_GLOBAL_BATCH = 16
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

#: `--data packed --topologies all`: the full matrix without cp4 (packed sequences split over cp <= 2).
PACKED_TOPOLOGIES = tuple(spec for spec in ALL_TOPOLOGIES if "cp4" not in spec)

#: Thresholds are calibrated up to this many optimizer steps (proof/oracle/thresholds.py).
MAX_STEPS = 20
MAX_SEED = 2**31 - 1  # numpy seeds each rank with seed + 100 * pp_rank: stay below 2**32


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
        f"'default' ({','.join(DEFAULT_TOPOLOGIES)}; with --layout-invariant {len(LAYOUT_TOPOLOGIES)} tp/sp/dp/pp/ep "
        f"layouts) or 'all' ({len(ALL_TOPOLOGIES)} topologies, up to 8 ranks)",
    )
    parser.add_argument("--mutations", default="none", help="none, all, or a comma list of mutation names")
    parser.add_argument("--steps", default="2", help=f"optimizer steps K, 1 to {MAX_STEPS} (default 2)")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument(
        "--data",
        choices=("unpacked", "masked", "packed"),
        default="unpacked",
        help="unpacked (default; also named masked): one sample per row, its SFT prompt prefix and seeded holes "
        "masked, so valid tokens differ per sample, microbatch, DP and CP rank; packed: THD rows of three "
        "sequences of unequal lengths, masked per sequence, split per sequence over CP (up to cp2)",
    )
    parser.add_argument(
        "--model",
        choices=("dense", "moe", "hybrid", "mla", "deepseek", "auto"),
        default="auto",
        help="auto: the MoE model for topologies with ep/etp, the dense GQA model otherwise; "
        "hybrid: a HybridModel of attention and MLP layers (Megatron-Core 0.18+); "
        "mla: multi-latent attention (DeepSeek-V3 shaped); deepseek: MLA plus DeepSeek-V3's MoE routing "
        "(sigmoid, expert bias, group-limited top-k, scaling factor), a shared expert, a leading dense layer",
    )
    parser.add_argument("--json", metavar="PATH", help="write the machine-readable report here")
    parser.add_argument("--plot", metavar="PATH", help="write a PNG heat map of per-layer errors (needs matplotlib)")
    parser.add_argument("--seed", default="1234", help=f"0 to {MAX_SEED} (default 1234)")
    parser.add_argument(
        "--layout-invariant",
        action="store_true",
        help="run with the layout_invariant patch; pass only on bitwise-identical results (tp, sp, dp, pp "
        "topologies; MoE with ep and etp)",
    )
    parser.add_argument("--tp-invariant", action="store_true", help="deprecated name of --layout-invariant")
    parser.add_argument(
        "--timeout", default="600",
        help=f"seconds per run before a world is killed (default 600, at most {checks.MAX_TIMEOUT_S})",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="show the ranks' Megatron/torch warnings")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from megatron_lora_patch.proof.oracle.harness import run_oracle

    topologies, mutations, settings = check_arguments(args)
    report = run_oracle(topologies, mutations, settings, rank_warnings="default" if args.verbose else "ignore")
    print(report.table())
    if args.json:
        report.write_json(args.json)
    if args.plot:
        from megatron_lora_patch.proof.oracle import plot

        plot.heat_map(report, args.plot)
    return 0 if report.passed else 1


def check_arguments(args: argparse.Namespace) -> tuple:
    """(topologies, mutations, settings) from the command line, or one OracleError (a UsageError)
    naming the option, the value and the fix: every check runs before any world is spawned."""
    from megatron_lora_patch.proof.oracle.harness import OracleError, OracleSettings, check_topology, mutations_named
    from megatron_lora_patch.proof.oracle.mutations import MUTATIONS
    from megatron_lora_patch.proof.testbed.topology import Topology
    from megatron_lora_patch.runtime import flags, registry

    if flags.requested_plugins():  # every rank's start-up hook activates them: a mistake is one line here, not
        registry.get_runtime().apply()  # a rank traceback (as the preflight's own `import megatron` does)
    settings = OracleSettings(
        steps=_integer("--steps", args.steps, 1, MAX_STEPS),
        dtype=args.dtype,
        seed=_integer("--seed", args.seed, 0, MAX_SEED),
        model=args.model,
        layout_invariant=(layout := args.layout_invariant or _deprecated_tp_invariant(args)),
        global_batch_size=LAYOUT_GLOBAL_BATCH if layout else OracleSettings.global_batch_size,
        timeout_s=checks.seconds("--timeout", args.timeout),
        data="unpacked" if args.data == "masked" else args.data,  # the unpacked rows are the masked SFT case
    )
    default = LAYOUT_TOPOLOGIES if settings.layout_invariant else DEFAULT_TOPOLOGIES
    if settings.model in ("moe", "deepseek"):  # Megatron-Core trains MoE layers under TP only with SP
        default = tuple(spec for spec in default if Topology.parse(spec).tp == 1 or Topology.parse(spec).sp)
    everything = ALL_TOPOLOGIES if settings.data == "unpacked" else PACKED_TOPOLOGIES
    topologies = _select(args.topologies, "--topologies", {"default": default, "all": everything})
    mutations = mutations_named(_select(args.mutations, "--mutations", {"none": (), "all": tuple(MUTATIONS)}))
    if settings.layout_invariant and mutations:
        raise OracleError(
            "--layout-invariant runs without mutations: they re-introduce bugs the invariant mode "
            "bypasses; drop --mutations"
        )
    for spec in topologies:
        topology = Topology.parse(spec)
        if topology.world_size == 1:
            raise OracleError(
                f"--topologies: {spec!r} is the world-1 reference itself; list topologies of 2 or more ranks"
            )
        check_topology(topology, settings)
    for option in ("--json", "--plot"):
        if getattr(args, option[2:]):
            checks.check_writable(option, getattr(args, option[2:]))
    if args.plot and not args.plot.lower().endswith(".png"):
        raise OracleError(f"--plot {args.plot}: the heat map is a PNG; give a path ending in .png")
    if args.plot:
        try:
            import matplotlib  # noqa: F401  (the heat map's one extra requirement)
        except ImportError:
            raise OracleError("--plot needs matplotlib: pip install 'megatron-lora-patch[plot]'") from None
    return topologies, mutations, settings


def _deprecated_tp_invariant(args: argparse.Namespace) -> bool:
    if args.tp_invariant:
        print("megatron-lora-patch oracle: --tp-invariant is deprecated; use --layout-invariant", file=sys.stderr)
    return args.tp_invariant


def _select(value: str, option: str, named: dict) -> tuple:
    from megatron_lora_patch.proof.oracle.harness import OracleError

    if value in named:
        return tuple(named[value])
    items = tuple(item.strip() for item in value.split(",") if item.strip())
    if not items:
        raise OracleError(f"{option} needs {', '.join(named)} or a comma list; got {value!r}")
    repeated = [item for index, item in enumerate(items) if item in items[:index]]
    if repeated:
        raise OracleError(f"{option} lists {repeated[0]!r} twice; give each once")
    return items


def _integer(option: str, text: str, low: int, high: int) -> int:
    from megatron_lora_patch.proof.oracle.harness import OracleError

    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or not low <= value <= high:
        raise OracleError(f"{option} must be an integer from {low} to {high}, got {text!r}")
    return value
