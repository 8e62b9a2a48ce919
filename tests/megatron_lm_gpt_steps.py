"""The body of `megatron_lm_gpt.py` (the launch script): the steps `pretrain_gpt.py` hands to Megatron-LM.

It calls `megatron.training.pretrain` the way `pretrain_gpt.py` does for the installed
Megatron-LM (0.17: argument providers; 0.18: a config container and a model provider;
0.19+: a config container whose model config builds the model), with its own dataset
provider (mock GPT data, or `--data-path`'s indexed documents), `forward_step` / `loss_func`
contract and NullTokenizer. Nothing in it knows about LoRA: the plugin comes in only through
the environment.

For the tests, `LOOP_RECORD_DIR` names a directory where each rank holding the loss (last
pipeline stage, TP rank 0, CP rank 0) writes `dp<rank>.json`: its per-microbatch (loss sum, tokens), summed
over the CP group; and `graphs-dp<rank>.json`: how many graphs torch.compile built in that process (Megatron's
fused functions compiled, or run eagerly under `TORCH_COMPILE_DISABLE=1`).
"""

from __future__ import annotations

import inspect
import json
import os
from functools import partial

import torch
from megatron.core import parallel_state
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.enums import ModelType
from megatron.training import get_args, get_tokenizer, pretrain, print_rank_0
from megatron.training.utils import get_blend_and_blend_per_split

try:  # Megatron-LM 0.17 / 0.18: the helpers read the iterator themselves
    from megatron.training.utils import get_batch_on_this_cp_rank, get_batch_on_this_tp_rank

    BATCH_HELPERS_READ_ITERATOR = True
except ImportError:  # 0.19+: they moved to megatron.core.utils and take the batch and the groups
    from megatron.core.utils import get_batch_on_this_cp_rank, get_batch_on_this_tp_rank

    BATCH_HELPERS_READ_ITERATOR = False

RECORD: list = []


def _first_or_last_stage(vp_stage=None) -> bool:
    return parallel_state.is_pipeline_first_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage) or (
        parallel_state.is_pipeline_last_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage)
    )


def _tp_broadcast_batch(data_iterator) -> dict:
    """0.19+: TP rank 0 reads the microbatch, the helper broadcasts it over the TP group."""
    args = get_args()
    batch = {}
    if parallel_state.get_tensor_model_parallel_rank() == 0:
        batch = {
            key: value.cuda(non_blocking=True) if torch.is_tensor(value) else value
            for key, value in next(data_iterator).items()
        }
    return get_batch_on_this_tp_rank(
        batch,
        broadcast_src_rank=parallel_state.get_tensor_model_parallel_src_rank(),
        broadcast_group=parallel_state.get_tensor_model_parallel_group(),
        has_cu_seqlens=False,
        is_hybrid_cp=False,
        create_attention_mask_in_dataloader=args.create_attention_mask_in_dataloader,
        cp_size=args.context_parallel_size,
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        micro_batch_size=args.micro_batch_size,
        seq_length=args.seq_length,
        mtp_on_this_rank=False,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        is_pipeline_first_stage=parallel_state.is_pipeline_first_stage(),
        is_pipeline_last_stage=parallel_state.is_pipeline_last_stage(),
    )


def get_batch(data_iterator, vp_stage=None):
    """This rank's (tokens, labels, loss_mask, attention_mask, position_ids); None off the end stages."""
    if not _first_or_last_stage(vp_stage):
        return None, None, None, None, None
    if BATCH_HELPERS_READ_ITERATOR:
        batch = get_batch_on_this_cp_rank(get_batch_on_this_tp_rank(data_iterator))
    else:
        batch = get_batch_on_this_cp_rank(
            _tp_broadcast_batch(data_iterator), is_hybrid_cp=False, cp_group=parallel_state.get_context_parallel_group()
        )
    return batch["tokens"], batch["labels"], batch["loss_mask"], batch.get("attention_mask"), batch["position_ids"]


def _record(loss: torch.Tensor, num_tokens: torch.Tensor) -> None:
    """Keep the microbatch's (loss sum, tokens) for `LOOP_RECORD_DIR`, summed over the CP group (each CP rank holds
    a slice of the sequence); TP rank 0 of CP rank 0 keeps it. The training itself reads neither."""
    if parallel_state.get_tensor_model_parallel_rank() != 0:
        return
    totals = torch.stack([loss.detach().double(), num_tokens.double()]).cpu()
    if parallel_state.get_context_parallel_world_size() > 1:
        torch.distributed.all_reduce(totals, group=parallel_state.get_context_parallel_group())
    if parallel_state.get_context_parallel_rank() == 0:
        RECORD.append([totals[0].item(), int(totals[1])])


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor, model=None):
    """Summed masked loss, token count and report: the per-token contract of `pretrain_gpt.py`."""
    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    _record(loss, num_tokens)
    return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}


def forward_step(data_iterator, model, return_schedule_plan: bool = False):
    """Forward one microbatch; the loss function gets its loss mask."""
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(data_iterator, getattr(model, "vp_stage", None))
    output_tensor = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)
    return output_tensor, partial(loss_func, loss_mask, model=model)


def _tokenizer(args):
    try:  # 0.17+: the core tokenizers (pretrain_gpt.py builds them unless --legacy-tokenizer)
        from megatron.core.tokenizers.text.utils.build_tokenizer import build_tokenizer
    except ImportError:
        return get_tokenizer()
    return get_tokenizer() if getattr(args, "legacy_tokenizer", False) else build_tokenizer(args)


def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None):
    """GPT datasets (`--mock-data`, else `--data-path`'s indexed documents), built on the end pipeline stages'
    TP rank 0 only."""
    args = get_args()
    blend, blend_per_split = get_blend_and_blend_per_split(args)
    config = GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=args.split,
        path_to_cache=args.data_cache_path,
        tokenizer=_tokenizer(args),
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader,
    )
    dataset_type = MockGPTDataset if args.mock_data else GPTDataset
    print_rank_0(f"> building {dataset_type.__name__} datasets ...")

    def built_on_this_rank():
        return _first_or_last_stage(vp_stage) and parallel_state.get_tensor_model_parallel_rank() == 0

    return BlendedMegatronDatasetBuilder(dataset_type, train_val_test_num_samples, built_on_this_rank, config).build()


def layer_spec(args):
    """Megatron's local (non-TE) GPT layer spec; with `--context-parallel-size` > 1 its core attention is the
    testbed's `ContextParallelDotProductAttention`, the CPU stand-in for Transformer Engine's attention (Megatron's
    local `DotProductAttention` refuses CP; on GPUs users run TE's). It applies the `[b, 1, s/cp, s]` attention
    mask `get_batch_on_this_cp_rank` leaves (`--reset-attention-mask`: the document boundaries) to the CP-gathered
    keys."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(args.num_experts, args.moe_grouped_gemm, normalization=args.normalization)
    if args.context_parallel_size > 1:
        from megatron_lora_patch.proof.testbed.cp_attention import ContextParallelDotProductAttention

        spec.submodules.self_attention.submodules.core_attention = ContextParallelDotProductAttention
    return spec


def model_provider(pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None):
    """GPTModel with the local (non-TE) layer spec of `layer_spec` (Megatron-LM 0.17 / 0.18 take a provider)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.training.arguments import core_transformer_config_from_args

    args = get_args()
    config = config or core_transformer_config_from_args(args)
    return GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(args),
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
        vp_stage=vp_stage,
    )


def main() -> None:
    train_valid_test_datasets_provider.is_distributed = True
    first = next(iter(inspect.signature(pretrain).parameters))
    if first != "cfg_container":  # Megatron-LM 0.17: pretrain parses the arguments
        pretrain(
            train_valid_test_datasets_provider,
            model_provider,
            ModelType.encoder_or_decoder,
            forward_step,
            args_defaults={"tokenizer_type": "NullTokenizer"},
        )
    else:
        from megatron.training import argument_utils
        from megatron.training.arguments import parse_and_validate_args

        args = parse_and_validate_args(args_defaults={"tokenizer_type": "NullTokenizer"})
        if hasattr(argument_utils, "gpt_config_from_args"):  # 0.19+: the model config builds the model
            model_config = argument_utils.gpt_config_from_args(args)
            if args.context_parallel_size > 1:  # otherwise the builder's own (local) spec
                model_config.transformer_layer_spec = layer_spec(args)
            full_config = argument_utils.pretrain_cfg_container_from_args(args, model_config)
            pretrain(full_config, train_valid_test_datasets_provider, ModelType.encoder_or_decoder, forward_step)
        else:
            full_config = argument_utils.pretrain_cfg_container_from_args(args)
            pretrain(
                full_config,
                train_valid_test_datasets_provider,
                model_provider,
                ModelType.encoder_or_decoder,
                forward_step,
            )
    record_dir = os.environ.get("LOOP_RECORD_DIR")
    if record_dir and RECORD:
        path = os.path.join(record_dir, f"dp{parallel_state.get_data_parallel_rank()}.json")
        with open(path, "w") as handle:
            json.dump(RECORD, handle)
        from torch._dynamo.utils import counters

        with open(os.path.join(record_dir, f"graphs-{os.path.basename(path)}"), "w") as handle:
            json.dump(counters["stats"]["unique_graphs"], handle)

