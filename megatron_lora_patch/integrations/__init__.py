"""One module per patch: the wrapper functions a patch declaration (`megatron_lora_patch.patches`)
installs on Megatron-Core, and the only code of the package that knows Megatron's call signatures
and reports through the runtime. The libraries below (`lora`, `layout_invariant`, `cpu_testbed`) are
plain modules, testable without patching (docs/architecture.md section 2)."""
