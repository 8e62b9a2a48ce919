"""The `megatron-lora-patch` command (also `python -m megatron_lora_patch`)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Optional, Sequence

from megatron_lora_patch import cli_export, flags
from megatron_lora_patch.oracle import command as oracle_command


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="megatron-lora-patch", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    status = commands.add_parser("status", help="what is applied, skipped, and why")
    status.add_argument("--json", action="store_true", help="print a JSON document instead of a table")
    status.add_argument(
        "--plugins", help=f"comma list of plugins (default: ${flags.PLUGINS_VARIABLE})", default=None
    )
    status.add_argument(
        "--no-import", action="store_true", help="do not import the target modules (states stay 'not imported yet')"
    )
    status.set_defaults(run=run_status)
    cli_export.add_parser(commands)
    oracle_command.add_parser(commands)
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except (flags.FlagError, LookupError, ValueError) as error:
        print(f"megatron-lora-patch: error: {error}", file=sys.stderr)
        return 2


def run_status(args: argparse.Namespace) -> int:
    from megatron_lora_patch import runtime

    plugins = (
        flags.parse_names("--plugins", args.plugins) if args.plugins is not None else flags.requested_plugins()
    )
    installed = sorted(runtime.installed_plugins())
    if not plugins:
        message = (
            f"{flags.PLUGINS_VARIABLE} is unset: no plugin is active and nothing is patched. "
            f"Installed plugins: {', '.join(installed) or 'none'}. "
            "Preview one with: megatron-lora-patch status --plugins lora_correct"
        )
        if args.json:
            print(json.dumps({"plugins": [], "installed_plugins": installed, "patches": [], "message": message}))
        else:
            print(message)
        return 0
    rows = runtime.apply(plugins)
    if not args.no_import:
        runtime.get_runtime().import_targets()
        rows = runtime.status()
    if args.json:
        document = {"plugins": plugins, "installed_plugins": installed, "patches": [r.as_dict() for r in rows]}
        print(json.dumps(document, indent=2))
    else:
        print(format_table(rows))
    return 1 if any(row.state == "failed" for row in rows) else 0


def format_table(rows: Sequence["object"]) -> str:
    """One aligned row per patch, its targets listed underneath (they are long)."""
    header = ("plugin", "patch", "tested", "megatron-core", "enabled", "state")
    cells = [header] + [
        (
            r.plugin,
            r.patch,
            r.tested,
            r.installed,
            f"{'on' if r.enabled else 'off'} ({r.source})",
            r.state + (f": {r.detail}" if r.detail else ""),
        )
        for r in rows  # type: ignore[attr-defined]
    ]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header) - 1)]
    lines = []
    for index, row in enumerate(cells):
        lines.append("  ".join(cell.ljust(width) for cell, width in zip(row, widths)) + "  " + row[-1])
        if index:
            lines += [f"    target {target}" for target in rows[index - 1].target.split(", ")]  # type: ignore[attr-defined]
    return "\n".join(lines)
