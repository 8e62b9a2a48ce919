"""`megatron-lora-patch export`: an adapter-only Megatron checkpoint -> a Hugging Face PEFT adapter."""

from __future__ import annotations

import argparse
import warnings


def add_parser(commands) -> None:
    """Register the `export` subcommand on the CLI's subparsers."""
    export = commands.add_parser(
        "export",
        help="write adapter_model.safetensors + adapter_config.json from an adapter-only checkpoint",
        description=(
            "Read an adapter-only distributed checkpoint (written by "
            "megatron_lora_patch.lora.checkpoint.save_adapters on any topology) and write a PEFT LoRA "
            "adapter: fused qkv split into q/k/v_proj (GQA), SwiGLU fc1 into gate/up_proj."
        ),
    )
    export.add_argument("--checkpoint", required=True, help="adapter-only dist checkpoint directory")
    export.add_argument("--out", required=True, help="output directory for the PEFT adapter")
    export.add_argument("--family", default="llama", help="HF module names: llama (default), mistral, qwen2, qwen3")
    export.set_defaults(run=run_export)


def run_export(args: argparse.Namespace) -> int:
    with warnings.catch_warnings():
        # Megatron's import-time notices (no Transformer Engine / Apex) are noise for a file conversion.
        warnings.simplefilter("ignore")
        from megatron_lora_patch.lora.exchange import export_peft

        tensors = export_peft(args.checkpoint, args.out, args.family)
    print(f"wrote {len(tensors)} tensors to {args.out}")
    return 0
