"""Test-only start-up: the CPU testbed (`cpu_compat` alone) for runs without the LoRA plugin.

Megatron-LM needs CUDA; on a CPU machine a run "without the plugin" still needs the host
fixes. With this directory on PYTHONPATH, every interpreter applies `cpu_compat` and no
other patch, whether or not the package's own start-up hook is installed, so the two runs
of the "plugin unset == not installed" check differ only in that hook.
"""

from megatron_lora_patch.proof.testbed.patches import apply_only

apply_only(("cpu_compat",))
