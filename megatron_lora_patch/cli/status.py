"""`megatron-lora-patch status`: what is applied, skipped, and why, with the attributes each
patch really changed (its patcher's records)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence

from megatron_lora_patch.cli import quiet
from megatron_lora_patch.runtime import errors, flags


def add_parser(commands) -> None:
    """Register the `status` subcommand on the CLI's subparsers."""
    status = commands.add_parser("status", help="what is applied, skipped, and why")
    status.add_argument("--json", action="store_true", help="print a JSON document instead of a table")
    status.add_argument("--plugins", help=f"comma list of plugins (default: ${flags.PLUGINS_VARIABLE})", default=None)
    status.add_argument(
        "--no-import", action="store_true", help="do not import the target modules (states stay 'not imported yet')"
    )
    quiet.add_verbose(status)
    status.set_defaults(run=run_status)


def run_status(args: argparse.Namespace) -> int:
    """Validate every flag (a mistake: one line, exit 2), apply in this process, import the
    targets, and show per patch what this process got and what a fresh training process would
    (Megatron / torch import notices hidden unless `-v`)."""
    with quiet.quiet(args.verbose, imports_torch=not args.no_import):
        return _status(args)


def _status(args: argparse.Namespace) -> int:
    from megatron_lora_patch.runtime import bootstrap as _bootstrap
    from megatron_lora_patch.runtime import registry

    env_plugins = flags.requested_plugins()
    plugins = flags.parse_names(args.plugins) if args.plugins is not None else env_plugins
    if args.plugins is not None and not plugins:  # an empty --plugins is no preview of the (perhaps set) variable
        raise errors.UsageError(
            f"--plugins {args.plugins!r} names no plugin; give a comma list such as --plugins lora_correct, "
            f"or leave --plugins out to show what {flags.PLUGINS_VARIABLE} selects"
        )
    installed = sorted(registry.installed_plugins())
    hook = _bootstrap.startup_hook()
    if not plugins:
        message = (
            f"{flags.PLUGINS_VARIABLE} is unset: no plugin is active and nothing is patched. "
            f"Installed plugins: {', '.join(installed) or 'none'}. "
            "Preview one with: megatron-lora-patch status --plugins lora_correct"
        )
        if args.json:
            document = {
                "plugins": [],
                "installed_plugins": installed,
                "startup_hook": hook,
                "patches": [],
                "message": message,
            }
            print(json.dumps(document))
        else:
            print(message)
        return 0
    registry.apply(plugins)
    error = None if args.no_import else registry.get_runtime().import_targets()
    rows = registry.status()
    fresh = [fresh_process_state(row, hook, env_plugins) for row in rows]
    if args.json:
        document = {
            "plugins": plugins,
            "installed_plugins": installed,
            "startup_hook": hook,
            "patches": [{**row.as_dict(), "fresh_process": state} for row, state in zip(rows, fresh)],
            "megatron_core": megatron_core_source(),
            "error": str(error) if error else None,
        }
        print(json.dumps(document, indent=2))
    else:
        print(format_table(rows, fresh, hook))
        print(megatron_core_line(megatron_core_source()))
    if error is not None:
        print(errors.one_line(error), file=sys.stderr)
    undelivered = any(row.state in ("failed", "untested") for row in rows) or (env_plugins and not hook["installed"])
    return 1 if error is not None or undelivered else 0


def fresh_process_state(row: "object", hook: dict, env_plugins: Sequence[str]) -> str:
    """What a training process started now with this environment would get for `row`'s patch."""
    if not hook["installed"]:
        return "nothing: start-up hook not installed"
    if row.plugin not in env_plugins:  # type: ignore[attr-defined]
        return f"nothing: {flags.PLUGINS_VARIABLE} does not name {row.plugin}"  # type: ignore[attr-defined]
    return "applies on import" if row.state == "not imported yet" else row.state  # type: ignore[attr-defined]


def format_table(rows: Sequence["object"], fresh: Sequence[str], hook: dict) -> str:
    """One aligned row per patch, its targets listed underneath (they are long), then the hook."""
    header = ("plugin", "patch", "tested", "megatron-core", "enabled", "fresh process", "this process")
    cells = [header] + [
        (
            r.plugin,
            r.patch,
            r.tested,
            r.installed,
            f"{'on' if r.enabled else 'off'} ({r.source})",
            state,
            r.state_text(),
        )
        for r, state in zip(rows, fresh)  # type: ignore[attr-defined]
    ]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header) - 1)]
    lines = []
    for index, row in enumerate(cells):
        lines.append("  ".join(cell.ljust(width) for cell, width in zip(row, widths)) + "  " + row[-1])
        if index:
            targets = rows[index - 1].target.split(", ")  # type: ignore[attr-defined]
            lines += [f"    target {target}" for target in targets]
    where = (
        f"installed at {hook['path']}"
        if hook["installed"]
        else (
            "NOT installed in any site directory on sys.path, so a training process gets no patch; "
            "reinstall the package"
        )
    )
    ran = "ran in this process" if hook["ran_here"] else "did not run in this process"
    lines.append(f"start-up hook: {where} ({ran})")
    return "\n".join(lines)


def megatron_core_source() -> dict:
    """Which Megatron-Core this process imports (version and directory: a source checkout on the path wins over
    the installed wheel), the wheel's version, and the one a script started in the working directory would
    import when that directory holds another (`python pretrain_gpt.py` in a Megatron-LM checkout)."""
    import importlib.metadata
    import os

    from megatron_lora_patch.runtime import versions

    resolved = versions.resolved_megatron_core()
    version, path = (str(resolved[0]) if resolved[0] else None, resolved[1]) if resolved else (None, None)
    try:
        wheel = importlib.metadata.version(versions.DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        wheel = None
    here, local = os.path.join(os.getcwd(), "megatron", "core"), None
    elsewhere = path is None or os.path.realpath(path) != os.path.realpath(here)
    if elsewhere and os.path.isfile(os.path.join(here, "__init__.py")):
        found = versions.package_version(os.path.join(here, "package_info.py"))
        local = {"version": str(found) if found else None, "path": here}
    return {"version": version, "path": path, "wheel": wheel, "working_directory": local}


def megatron_core_line(source: dict) -> str:
    """`megatron_core_source` for a person: the version and where it comes from, and what differs."""
    if source["path"] is None:
        line = "megatron-core: none found on sys.path"
    else:
        line = f"megatron-core: {source['version'] or 'unknown version'} imported from {source['path']}"
        if source["wheel"] is not None and source["wheel"] != source["version"]:
            line += f" (not the installed megatron-core {source['wheel']} wheel)"
    local = source["working_directory"]
    if local is not None:
        line += (f"; a script started in this directory (such as pretrain_gpt.py) imports megatron-core "
                 f"{local['version'] or 'of unknown version'} from {local['path']} instead")
    return line
