"""The documented CPU fine-tune commands run as written (issue 27).

The one bash block of docs/testing.md "Megatron-LM on CPU" (a base without LoRA, LoRA on it at
TP2, the export) runs with `bash -e` in an empty directory holding `pretrain_gpt.py` (the tests' launch
script, `tests/megatron_lm_gpt.py`), with `torchrun` and `megatron-lora-patch` of this environment first
on PATH. The only text replaced is the placeholder `<your usual arguments>`: the tiny GQA SwiGLU model and
mock-data training arguments of tests/test_megatron_lm_loop.py. A wrong variable, plugin or flag in the
documented commands fails here.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys

import pytest

if importlib.util.find_spec("megatron.training") is None:
    pytest.skip("megatron.training is absent: megatron-core < 0.17 ships no training loop", allow_module_level=True)

from conftest import REPO, clean_environ  # noqa: E402
from megatron_lm_runs import MODEL_ARGS, SCRIPT, TRAIN_ARGS  # noqa: E402

PLACEHOLDER = "<your usual arguments>"
USUAL_ARGUMENTS = MODEL_ARGS + TRAIN_ARGS  # --save-interval is in the documented CPU arguments
BASE_INFO = "holds no adapters (a base checkpoint): the base weights load as saved"


def doc_block(document: str, section: str) -> str:
    """The one ```bash block of `document`'s `## section` (a path under the repository)."""
    text = (REPO / document).read_text()
    part = text.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", part, re.S)
    assert len(blocks) == 1, blocks
    return blocks[0]


def _tools(directory) -> str:
    """A PATH entry whose `torchrun` and `megatron-lora-patch` are this interpreter's."""
    directory.mkdir()
    for name, module in (("torchrun", "torch.distributed.run"), ("megatron-lora-patch", "megatron_lora_patch")):
        tool = directory / name
        tool.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -m {module} "$@"\n')
        tool.chmod(0o755)
    return str(directory)


def test_the_cpu_fine_tune_commands_run_as_written(tmp_path):
    block = doc_block("docs/testing.md", "Megatron-LM on CPU")
    assert block.count(PLACEHOLDER) == 2
    work = tmp_path / "work"
    work.mkdir()
    (work / "pretrain_gpt.py").symlink_to(SCRIPT)
    environ = clean_environ(PATH=_tools(tmp_path / "bin") + os.pathsep + os.environ["PATH"])
    script = block.replace(PLACEHOLDER, shlex.join(USUAL_ARGUMENTS))
    done = subprocess.run(["bash", "-e", "-c", script], cwd=str(work), env=environ, capture_output=True, text=True,
                          timeout=900)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-5000:]
    assert output.count(BASE_INFO) == 1  # the LoRA run loaded the base the first command wrote
    assert re.search(r"^wrote \d+ tensors to peft_adapter$", done.stdout, re.M), done.stdout[-2000:]
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(os.listdir(work / "peft_adapter"))
