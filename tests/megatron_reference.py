"""A hand-written megatron-core training loop: what the Engine must match, and its baseline.

It uses megatron-core directly (GPTModel, DDP, get_megatron_optimizer, the no-pipelining
schedule) and plain PyTorch for the loss (log_softmax + gather), with none of the engine's
batching, heads or loss code. Only the model description is shared
(``transformer_config``) and its initialisation (``initialize_parameters``), so both build
the same model from the same seed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from engine.config import EngineConfig


class ReferenceLMTrainer:
    """SFT (token-mean NLL over ``loss_mask``) with fixed-size micro-batches, right padding."""

    def __init__(self, config: EngineConfig) -> None:
        from megatron.core import tensor_parallel
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        from strategies.backends.megatron.model import transformer_config
        from strategies.backends.megatron.weight_init import initialize_parameters

        self.config = config
        torch.manual_seed(config.seed)
        tensor_parallel.model_parallel_cuda_manual_seed(config.seed)
        model_config = transformer_config(config)
        model = GPTModel(
            config=model_config,
            transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
            vocab_size=config.model.vocab_size,
            max_sequence_length=config.model.max_sequence_length,
            share_embeddings_and_output_weights=False,
            position_embedding_type="rope",
            rotary_base=config.model.rotary_base,
        )
        initialize_parameters(model, config)
        self.model = DistributedDataParallel(
            config=model_config,
            ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True),
            module=model,
        )
        model_config.no_sync_func = self.model.no_sync

        def finalize(chunks: list[torch.nn.Module], num_tokens: Any = None, **kwargs: Any) -> None:
            finalize_model_grads(chunks, None, **kwargs)

        model_config.finalize_model_grads_func = finalize
        opt = config.optimizer
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam",
                lr=opt.lr,
                min_lr=opt.lr,
                weight_decay=opt.weight_decay,
                adam_beta1=opt.adam_beta1,
                adam_beta2=opt.adam_beta2,
                adam_eps=opt.adam_eps,
                clip_grad=opt.clip_grad,
            ),
            [self.model],
        )

    def train_step(
        self, sequences: Sequence[Sequence[int]], loss_masks: Sequence[Sequence[float]]
    ) -> float:
        """One optimizer step on the batch; returns the batch's token-mean NLL."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        size = self.config.micro_batch_size
        chunks = [
            (sequences[start : start + size], loss_masks[start : start + size])
            for start in range(0, len(sequences), size)
        ]
        total_tokens = float(sum(sum(mask) for mask in loss_masks))

        def forward_step(iterator: Any, model: Any) -> Any:
            rows, masks = next(iterator)
            width = max(len(row) for row in rows)
            ids = torch.zeros(len(rows), width, dtype=torch.long)
            mask = torch.zeros(len(rows), width)
            for i, (row, row_mask) in enumerate(zip(rows, masks, strict=True)):
                ids[i, : len(row)] = torch.tensor(row)
                mask[i, : len(row)] = torch.tensor(row_mask)
            positions = torch.arange(width).expand_as(ids)
            logits = model(ids, positions, attention_mask=None)

            def loss_func(output: torch.Tensor) -> Any:
                log_p = torch.log_softmax(output.float(), dim=-1)
                picked = log_p[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
                loss = -(picked * mask[:, 1:]).sum() / total_tokens
                return loss, torch.ones((), dtype=torch.int), {"loss": loss.detach().clone()}

            return logits, loss_func

        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        results = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(chunks),
            model=[self.model],
            num_microbatches=len(chunks),
            seq_length=max(len(row) for row in sequences),
            micro_batch_size=size,
        )
        self.optimizer.step()
        return float(sum(float(result["loss"]) for result in results))
