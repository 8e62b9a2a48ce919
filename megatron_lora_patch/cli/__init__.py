"""The `megatron-lora-patch` command (also `python -m megatron_lora_patch`).

Each subcommand lives in its own module with an `add_parser(commands)` that registers it on
the subparsers; `SUBCOMMANDS` lists them, and they are imported only when the command runs
(importing this module imports neither the oracle nor torch).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Optional, Sequence

from megatron_lora_patch.runtime import errors

#: Modules contributing a subcommand, in `--help` order.
SUBCOMMANDS = (
    "megatron_lora_patch.cli.status",
    "megatron_lora_patch.cli.export",
    "megatron_lora_patch.cli.oracle",
    "megatron_lora_patch.cli.preflight",
)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="megatron-lora-patch", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    for module_name in SUBCOMMANDS:
        importlib.import_module(module_name).add_parser(commands)
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except errors.UsageError as error:  # a user mistake: one line; anything else is a bug and keeps its traceback
        print(errors.one_line(error), file=sys.stderr)
        return 2
