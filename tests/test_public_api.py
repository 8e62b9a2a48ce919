"""The public API is the package root's `__all__` (docs/api.md): each name resolves to the object that does the
work, importing the root loads none of them, and the old module paths still work with one FutureWarning line."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import warnings

import pytest

import megatron_lora_patch
from megatron_lora_patch import handoff
from megatron_lora_patch.lora.checkpoints import checkpoint
from megatron_lora_patch.lora.exchange import transfer
from megatron_lora_patch.runtime import registry

EXPECTED = {
    "apply": registry.apply, "revert": registry.revert, "status": registry.status, "SkipPatch": registry.SkipPatch,
    "save_adapters": checkpoint.save_adapters, "load_adapters": checkpoint.load_adapters,
    "export_peft": transfer.export_peft, "import_peft": transfer.import_peft, "handoff": handoff,
}


def test_every_public_name_is_the_working_object():
    assert sorted(megatron_lora_patch.__all__) == sorted(EXPECTED)
    for name, expected in EXPECTED.items():
        assert getattr(megatron_lora_patch, name) is expected, name
    assert set(EXPECTED) <= set(dir(megatron_lora_patch))
    with pytest.raises(AttributeError, match="no attribute 'export'"):
        megatron_lora_patch.export  # noqa: B018


def test_importing_the_root_loads_no_public_module():
    code = ("import json, sys, megatron_lora_patch; "
            "print(json.dumps(sorted(m for m in sys.modules if m.startswith(('megatron_lora_patch.', 'torch')))))")
    loaded = json.loads(subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True,
                                       check=True).stdout)
    assert loaded == []


@pytest.mark.parametrize("old, names, public", [
    ("megatron_lora_patch.lora.checkpoint", ("save_adapters", "load_adapters"), "megatron_lora_patch.save_adapters"),
    ("megatron_lora_patch.lora.peft_io", ("export_peft", "import_peft"), "megatron_lora_patch.export_peft"),
])
def test_a_moved_path_still_works_and_warns_once_in_one_line(old, names, public):
    sys.modules.pop(old, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(old)
        importlib.import_module(old)  # a second import is the cached module: no second warning
    assert [warning.category for warning in caught] == [FutureWarning]
    message = str(caught[0].message)
    assert old in message and public in message and "\n" not in message
    for name in names:
        assert getattr(module, name) is getattr(megatron_lora_patch, name)
