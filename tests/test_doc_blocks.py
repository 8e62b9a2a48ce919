"""Every fenced block of README.md and docs/*.md is accounted for by a test (issue 38).

`BLOCKS` lists each block by its document and first line (imports aside), with how it is proven:

- `RUN`: this file runs it as written (`status`, the environment lines that disable a patch, the logging line);
- `elsewhere(test)`: that test runs it, or its CPU form (the placeholders it names replaced);
- `NEEDS(reason)`: it needs what CI has not (GPUs, the network, an inference engine, a model); this file checks
  what can be checked without them: every `--flag` a command passes is one the program it is passed to accepts
  (Megatron-LM's argument parser, torchrun's, this package's CLI), and every `handoff.NAME(...)` a Python block
  calls exists and accepts the keywords given;
- `OUTPUT`: a plain block showing output (no language), not a command.

A block added, removed or given another first line fails `test_every_block_is_accounted_for` until its row says
how it is proven. Every bash block gets the flag check, whatever its row.
"""

from __future__ import annotations

import ast
import inspect
import pathlib
import re
import shlex
import subprocess
import sys

import pytest
from conftest import REPO, clean_environ, run_in_process

DOCUMENTS = ["README.md", *sorted(str(path.relative_to(REPO)) for path in (REPO / "docs").glob("*.md"))]
RUN, OUTPUT = "run here", "output"
CPU_FORM = "tests/test_readme_commands.py::test_the_cpu_fine_tune_commands_run_as_written"
MAIN_JOB = "MEGATRON_PLUGINS=lora_correct torchrun --nproc-per-node 8 pretrain_gpt.py <your usual arguments>"


def elsewhere(test: str) -> str:
    return f"run by {test}"


def needs(reason: str) -> str:
    return f"needs {reason}"


#: (document, first line) -> how the block is proven.
BLOCKS = {
    ("README.md", "pip install torch==2.13.0 && pip install . && megatron-lora-patch oracle"):
        elsewhere("scripts/run-tests.sh (each leg: torch==2.13.0, the wheel, `megatron-lora-patch oracle`)"),
    ("README.md", MAIN_JOB): elsewhere(CPU_FORM + "; its `status` line runs here"),
    ("README.md", "MEGATRON_PLUGINS=lora_correct MEGATRON_LORA_RANK=16 \\"): elsewhere(CPU_FORM),
    ("README.md", MAIN_JOB + " \\"): needs(
        "GPUs and your SFT data; tests/test_megatron_lm_loop.py runs these data flags (megatron_lm_runs.sft_data_args)"
    ),
    ("README.md", "megatron-lora-patch preflight -- --num-layers 32 --hidden-size 4096 --num-attention-heads 32 \\"):
        needs("a node for a 4096-wide model; tests/test_preflight.py runs the same command on tiny widths"),
    ("README.md", 'state = handoff.adapter_state(model_chunks, family="qwen3_moe", dst=0)   # every rank calls it'):
        needs("a trained model and an inference engine; tests/test_handoff_engines.py makes these calls"),
    ("README.md", "bash scripts/run-tests.sh"): elsewhere(".ci/run (CI runs exactly this command)"),
    ("docs/checkpoints.md", "megatron-lora-patch: error: LoRA would train on a randomly initialised base: no "
     "checkpoint was found in WRONG_DIR; pass --pretrained-checkpoint BASE_DIR (or --load BASE_DIR --finetune), "
     "or set MEGATRON_LORA_ALLOW_RANDOM_BASE=1 to train on a random base on purpose (tests)"): OUTPUT,
    ("docs/checkpoints.md", "# first run: the base from BASE_DIR, checkpoints (adapter-sized) into LORA_DIR"):
        elsewhere("tests/test_fail_closed_megatron_lm.py (the resume form, on a CPU base)"),
    ("docs/export.md", 'AutoBridge.import_ckpt("meta-llama/Llama-3.2-1B", "base_ckpt")   # a Megatron checkpoint + '
     "Megatron-LM's tracker file"):
        needs("Megatron-Bridge and the network (a Hugging Face download)"),
    ("docs/export.md", "MEGATRON_PLUGINS=lora_correct torchrun --nproc-per-node 8 pretrain_gpt.py <architecture and "
     "training arguments> \\"): elsewhere(CPU_FORM),
    ("docs/export.md", "model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained("
     '"meta-llama/Llama-3.2-1B"), "peft_adapter")'):
        needs("the network (a Hugging Face download); tests/test_hf_round_trip.py loads an export with peft"),
    ("docs/fail-closed.md", "megatron-lora-patch: error: <what is wrong, with the value>; <the fix>"): OUTPUT,
    ("docs/fail-closed.md", "megatron-lora-patch: error: MEGATRON_PLUGINS names unknown plugin 'lora_corect'; did "
     "you mean 'lora_correct'?"): OUTPUT,
    ("docs/fail-closed.md", "import logging; logging.basicConfig(level=logging.DEBUG)"): RUN,  # (an import line only)
    ("docs/fail-closed.md", "MEGATRON_LORA_DISABLED_PATCHES=lora_checkpoint    # comma list"): RUN,
    ("docs/handoff.md", 'state = handoff.adapter_state(model_chunks, family="qwen3_moe", dst=0)  # collective: every '
     "rank calls it"): needs("a trained model; tests/test_handoff_state.py makes this call"),
    ("docs/handoff.md", "for step in range(num_steps):"):
        needs("a training loop and an inference engine; tests/test_handoff_engines.py makes these calls"),
    ("docs/testing.md", "export CUDA_DEVICE_MAX_CONNECTIONS=1"): elsewhere(CPU_FORM),
}


def blocks() -> list:
    """(document, language, text) of every fenced block, in document order."""
    found = []
    for document in DOCUMENTS:
        for language, text in re.findall(r"^```(\w*)\n(.*?)^```", (REPO / document).read_text(), re.S | re.M):
            found.append((document, language, text))
    return found


def _key(document: str, text: str) -> tuple:
    """A block's row: its document and first line that is neither blank nor an import."""
    lines = [line for line in text.splitlines() if line.strip() and not line.startswith(("import ", "from "))]
    return document, (lines or text.splitlines())[0]


def test_every_block_is_accounted_for():
    keys = [_key(document, text) for document, _, text in blocks()]
    assert len(keys) == len(set(keys)), "two blocks of one document share a first line: give one another"
    assert sorted(set(keys) - set(BLOCKS)) == [], "new or changed blocks: add their rows to BLOCKS"
    assert sorted(set(BLOCKS) - set(keys)) == [], "rows whose block is gone: remove them"
    assert all(language == "" for document, language, text in blocks() if BLOCKS[_key(document, text)] == OUTPUT)


def _block(document: str, first_line: str) -> str:
    return next(text for found, _, text in blocks() if _key(found, text) == (document, first_line))


def _status(script: str) -> dict:
    """Run `script` (ending in a `megatron-lora-patch status`) with bash; the table's rows by patch name."""
    done = subprocess.run(["bash", "-c", script], env=_path_environ(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return {row.split()[1]: row for row in done.stdout.splitlines() if row.startswith("lora_correct ")}


def test_the_status_line_runs_as_written():
    line = _block("README.md", MAIN_JOB).splitlines()[1]
    assert line.startswith("MEGATRON_PLUGINS=lora_correct megatron-lora-patch status")
    rows = _status(line)
    assert "on (default)   applied" in rows["lora_linear"], rows


def test_the_lines_that_disable_a_patch_disable_it():
    """Each documented line, exported, leaves `lora_checkpoint` disabled in `status` and nothing else."""
    text = _block("docs/fail-closed.md", "MEGATRON_LORA_DISABLED_PATCHES=lora_checkpoint    # comma list")
    for line in text.splitlines():
        rows = _status(f"set -a; {line}\nMEGATRON_PLUGINS=lora_correct megatron-lora-patch status")
        assert "off (env)" in rows["lora_checkpoint"] and "on (default)" in rows["lora_linear"], (line, rows)


def test_the_logging_line_runs():
    line = _block("docs/fail-closed.md", "import logging; logging.basicConfig(level=logging.DEBUG)")
    code = line + "import logging; assert logging.getLogger('megatron_lora_patch').isEnabledFor(logging.DEBUG)"
    done = subprocess.run([sys.executable, "-P", "-c", code], env=clean_environ(), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def _path_environ() -> dict:
    """This environment's `megatron-lora-patch` first on PATH (the console script of the installed wheel)."""
    return clean_environ(PATH=f"{pathlib.Path(sys.executable).parent}:{clean_environ()['PATH']}")


def _commands(text: str) -> list:
    """The block's commands as token lists: continuations joined, comments dropped, a quoted variable
    (`CPU_ARGS="..."`, over several lines) substituted where it is used, other assignments dropped."""
    variables = {}

    def assign(match) -> str:
        variables[match[1]] = " ".join(match[2].split())
        return ""

    text = re.sub(r'^([A-Z_]+)="([^"]*)"\n', assign, text, flags=re.M)
    for name, value in variables.items():
        text = text.replace(f"${name}", value)
    commands = []
    for line in text.replace("\\\n", " ").splitlines():
        tokens = shlex.split(line, comments=True)
        while tokens and re.match(r"^[A-Z_]+=", tokens[0]):
            tokens.pop(0)
        if tokens and tokens[0] != "export":
            commands.append(tokens)
    return commands


def _flags(tokens: list) -> list:
    return [token.split("=")[0] for token in tokens if token.startswith("--") and token != "--"]


@pytest.fixture(scope="module")
def megatron_lm_flags() -> set:
    pytest.importorskip("megatron.training", reason="not applicable to this Megatron-Core: no megatron.training")
    import argparse

    from megatron.training.arguments import add_megatron_arguments

    return set(add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))._option_string_actions)


def _our_flags(subcommand: str) -> set:
    done = run_in_process([subcommand, "--help"])
    return set(re.findall(r"--[\w-]+", done.stdout))


def _unknown_flags(tokens: list, megatron_lm: set) -> list:
    """The flags of one command that its program does not accept."""
    from torch.distributed.run import get_args_parser

    if tokens[0] == "torchrun":
        script = next(i for i, token in enumerate(tokens) if token.endswith(".py"))
        torchrun = set(get_args_parser()._option_string_actions)
        return [f for f in _flags(tokens[1:script]) if f not in torchrun] + [
            f for f in _flags(tokens[script + 1:]) if f not in megatron_lm
        ]
    if tokens[0] == "megatron-lora-patch":
        ours, end = _our_flags(tokens[1]), tokens.index("--") if "--" in tokens else len(tokens)
        return [f for f in _flags(tokens[2:end]) if f not in ours] + [
            f for f in _flags(tokens[end + 1:]) if f not in megatron_lm
        ]
    return []  # pip, bash: no flags of ours or Megatron's


@pytest.mark.parametrize("document, first_line", [_key(doc, text) for doc, lang, text in blocks() if lang == "bash"])
def test_every_flag_of_a_bash_block_is_accepted(document, first_line, megatron_lm_flags):
    commands = _commands(_block(document, first_line))  # none in a block of assignments only (run as written above)
    unknown = [flag for tokens in commands for flag in _unknown_flags(tokens, megatron_lm_flags)]
    assert unknown == [], f"{document}: flags no program accepts: {unknown}"


def test_every_handoff_call_in_a_python_block_exists_with_its_keywords():
    from megatron_lora_patch import handoff

    checked = 0
    for document, language, text in blocks():
        if language != "python" or "handoff" not in text:
            continue
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and getattr(
                node.func.value, "id", None
            ) == "handoff":
                function = getattr(handoff, node.func.attr)
                parameters = inspect.signature(function).parameters
                assert {keyword.arg for keyword in node.keywords} <= set(parameters), (document, node.func.attr)
                checked += 1
    assert checked >= 8  # adapter_state, convert, sglang_payload, vllm_payload in README and docs/handoff.md


def test_a_misspelled_flag_is_caught(megatron_lm_flags):
    """The control: one wrong letter, in each program's part of a command, is reported."""
    torchrun = ["torchrun", "--nproc-per-nod", "8", "pretrain_gpt.py", "--pretrained-checkpiont", "BASE"]
    ours = ["megatron-lora-patch", "preflight", "--stpes", "2", "--", "--num-layer", "4"]
    assert _unknown_flags(torchrun, megatron_lm_flags) == ["--nproc-per-nod", "--pretrained-checkpiont"]
    assert _unknown_flags(ours, megatron_lm_flags) == ["--stpes", "--num-layer"]
