"""`megatron-lora-patch preflight`: check LoRA on the user's own model and topology (their
`pretrain_gpt.py` arguments) against world size 1 (the logic: `proof/oracle/preflight.py`)."""

from __future__ import annotations

import argparse
import sys
import warnings

from megatron_lora_patch.cli import checks
from megatron_lora_patch.runtime.errors import UsageError, one_line

DEFAULT_MICROBATCHES = 2


def _positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (argparse prints the usage line and exits 2 otherwise)."""
    return _positive(text, int, "integer")


def _positive_float(text: str) -> float:
    """argparse type: a number > 0."""
    return _positive(text, float, "number")


def _positive(text: str, cast, what: str):
    try:
        value = cast(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive {what}, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive {what}, got {text!r}")
    return value


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "preflight",
        help="check LoRA on your own model and topology (your pretrain_gpt.py arguments) against world-1",
        description=_help_text(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--json", metavar="PATH", help="write the machine-readable report here")
    parser.add_argument("--steps", type=_positive_int, default=2, help="optimizer steps K (default 2)")
    parser.add_argument(
        "--layers", type=_positive_int, help="layers to keep (default: the fewest holding every layer kind)"
    )
    parser.add_argument("--seq-length", type=_positive_int, help="sequence length (default: your --seq-length)")
    parser.add_argument(
        "--micro-batches",
        type=_positive_int,
        default=DEFAULT_MICROBATCHES,
        help=f"microbatches per data-parallel rank and step (default {DEFAULT_MICROBATCHES})",
    )
    parser.add_argument(
        "--data-parallel-size",
        type=_positive_int,
        help="data-parallel size (default: the smallest that fits your expert grid)",
    )
    parser.add_argument(
        "--device",
        default="auto",
        help="where the ranks run: cpu (gloo), cuda (one GPU per rank, NCCL, your kernels and layer spec), or auto "
        "(cuda where torch sees a GPU; the default)",
    )
    parser.add_argument("--mutation", help="re-introduce one of the oracle's known bugs (the preflight must then FAIL)")
    parser.add_argument(
        "--max-memory-gib", type=float, help="memory the world-1 reference may use (default: available RAM)"
    )
    parser.add_argument(
        "--max-parameters",
        type=_positive_float,
        metavar="MILLIONS",
        help="a CPU time budget for the world-1 reference (default: none, memory only): a model over the budget is "
        "cut, experts, vocabulary, then widths (e.g. 50: minutes on a laptop)",
    )
    parser.add_argument(
        "--timeout", default="600", help=f"seconds per run before a world is killed (at most {checks.MAX_TIMEOUT_S})"
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="show the ranks' Megatron/torch warnings")
    parser.add_argument("megatron_args", nargs=argparse.REMAINDER, help="-- then your pretrain_gpt.py arguments")
    parser.set_defaults(run=run)


def _help_text() -> str:
    from megatron_lora_patch.proof.oracle import preflight

    return preflight.__doc__


def _check_options(options: argparse.Namespace) -> None:
    """The options `make_plan` does not read: --timeout as seconds in range, a writable --json path."""
    options.timeout = checks.seconds("--timeout", options.timeout)
    if options.json is not None:
        checks.check_writable("--json", options.json)


def run(options: argparse.Namespace) -> int:
    from megatron_lora_patch.proof.oracle import preflight, preflight_run

    with warnings.catch_warnings():
        if not options.verbose:  # Megatron's import-time notices (no Apex / TE) are noise in this process too
            warnings.simplefilter("ignore")
        try:
            _check_options(options)  # before the runs: minutes of training must not end on a bad --json path
            plan = preflight.make_plan(options)
        except UsageError as error:
            print(one_line(error), file=sys.stderr)
            return 2
        print(plan.summary(), flush=True)
        report = preflight_run.run_plan(plan)
    print(report.table())
    if options.json:
        report.write_json(options.json)
    return 0 if report.passed else 1
