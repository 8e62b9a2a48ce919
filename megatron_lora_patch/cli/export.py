"""`megatron-lora-patch export`: an adapter-only Megatron checkpoint -> a Hugging Face PEFT adapter."""

from __future__ import annotations

import argparse

from megatron_lora_patch.cli import quiet
from megatron_lora_patch.lora.exchange import family_table  # standard library only: `--help` imports no torch


def add_parser(commands) -> None:
    """Register the `export` subcommand on the CLI's subparsers."""
    export = commands.add_parser(
        "export",
        help="write adapter_model.safetensors + adapter_config.json from a checkpoint with LoRA adapters",
        description=(
            "Read the LoRA adapters (only) of a checkpoint the plugin wrote on any topology: a Megatron-LM "
            "--save directory (its latest iteration), an iter_NNNNNNN directory, or an adapter-only "
            "checkpoint (megatron_lora_patch.lora.checkpoints.checkpoint.save_adapters); write a PEFT LoRA "
            "adapter: fused qkv split into q/k/v_proj (GQA), SwiGLU fc1 into gate/up_proj. A non-empty "
            "--out is refused unless --force; the adapter is written beside it and moved into place when complete."
        ),
    )
    export.add_argument(
        "--checkpoint", required=True, help="Megatron-LM --save or iter_NNNNNNN directory, or adapter-only checkpoint"
    )
    export.add_argument("--out", required=True, help="output directory for the PEFT adapter")
    export.add_argument(
        "--family",
        default=None,
        help=f"HF model family: {', '.join(family_table.FAMILIES)} (MoE experts: "
        f"{', '.join(family_table.with_experts())}; shared experts too: "
        f"{', '.join(family_table.with_shared_experts())}; multi-latent attention: "
        f"{', '.join(family_table.with_mla())}); default: inferred from the checkpoint (multi-latent attention: "
        "deepseek_v3; else qwen3 / qwen3_moe with q / k layernorm, else llama / mixtral); refused, naming the "
        "mismatch, when the family cannot represent the model",
    )
    export.add_argument("--force", action="store_true", help="replace a non-empty --out")
    quiet.add_verbose(export)
    export.set_defaults(run=run_export)


def run_export(args: argparse.Namespace) -> int:
    # Megatron's import-time notices (no Transformer Engine / Apex) are noise for a file conversion.
    with quiet.quiet(args.verbose):
        from megatron_lora_patch.lora.exchange.transfer import ArgumentNames, export_peft

        names = ArgumentNames("--checkpoint", "--out", "--family", "pass --force")
        tensors = export_peft(args.checkpoint, args.out, args.family, overwrite=args.force, names=names)
    print(f"wrote {len(tensors)} tensors to {args.out}")
    return 0
