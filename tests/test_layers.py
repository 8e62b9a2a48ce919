"""The package's import graph has layers with arrows only downward (docs/architecture.md section 2).

registry (bootstrap, hookspecs, flags, versions, ...) < library (LoRA math, TP-invariant mode,
CPU host fixes) < patches and plugins < proof (testbed < oracle) < CLI. A module may import its
own layer or a lower one; the registry never imports LoRA, nothing below the proof imports it.
Read from the source with `ast` (imports inside functions count too), so a lazy import cannot
hide an upward arrow.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = "megatron_lora_patch"

#: First component under the package -> layer rank (higher may import lower).
LAYERS = {
    "registry": 0, "hookspecs": 0, "outcomes": 0, "patching": 0, "flags": 0, "versions": 0, "errors": 0,
    "_bootstrap": 0, "__init__": 0, "apply": 0, "revert": 0, "status": 0, "SkipPatch": 0,
    "lora": 1, "tp_invariant": 1, "layout_invariant": 1, "cpu_testbed": 1, "null_tokenizer_eod": 1,
    "patches": 2, "lora_correct": 2,
    "proof.testbed": 3, "proof.oracle": 4, "proof": 4,
    "cli": 5, "cli_status": 5, "cli_export": 5, "__main__": 5,
}


def _layer(module: str) -> int:
    parts = module.split(".")[1:] or ["__init__"]
    key = ".".join(parts[:2]) if parts[0] == "proof" and len(parts) > 1 else parts[0]
    return LAYERS[key]


def _modules():
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        yield ".".join(path.relative_to(ROOT).with_suffix("").parts), path
    for path in sorted((ROOT / "patches").glob("*.py")):
        yield f"{PACKAGE}.patches.{path.stem}", path


def _imports(module: str, path: pathlib.Path):
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names if alias.name.startswith(PACKAGE))
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[: len(package) - node.level + 1]) if node.level else ""
            source = ".".join(filter(None, [base, node.module]))
            if source == PACKAGE:  # `from megatron_lora_patch import x`: x names the module
                yield from (f"{PACKAGE}.{alias.name}" for alias in node.names)
            elif source.startswith(PACKAGE):
                yield source


def _upward(module: str, path: pathlib.Path):
    return [target for target in _imports(module, path) if _layer(target) > _layer(module)]


def test_every_import_points_down_or_sideways():
    upward = {module: _upward(module, path) for module, path in _modules()}
    assert {module: targets for module, targets in upward.items() if targets} == {}


@pytest.mark.parametrize(
    "line",
    [
        "from megatron_lora_patch.proof.oracle import harness",
        "from .lora import adapter",
        "    import megatron_lora_patch.cli_export",
        "from megatron_lora_patch import lora_correct",
    ],
)
def test_an_upward_import_is_seen(tmp_path, line):
    """Negative control: the same check flags an upward import written into a registry module."""
    source = tmp_path / "registry.py"
    source.write_text(f"def later():\n    pass\n\nif True:\n{line if line.startswith(' ') else '    ' + line}\n")
    assert _upward("megatron_lora_patch.registry", source) != []
