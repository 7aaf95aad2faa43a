"""A hand-written FSDP2 training loop: what the fsdp2 backend must match, and its baseline.

transformers' own causal LM (``AutoModelForCausalLM``, logits for every position),
``fully_shard`` per decoder layer and at the root, AdamW (no weight decay on norms and biases)
and ``clip_grad_norm_``, plain PyTorch for the loss (log_softmax + gather): none of the engine's
batching, heads or loss code. Shared with the backend: the architecture
(``hf_config_for``) and the (seed, name) initialisation, so both build the same model.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.config import EngineConfig


class ReferenceFsdp2Trainer:
    """SFT (token-mean NLL over ``loss_mask``) with fixed-size micro-batches, right padding, on
    one process (the default process group must exist)."""

    def __init__(self, config: EngineConfig) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from transformers import AutoModelForCausalLM

        from strategies.backends.fsdp2.model import initialize_parameters
        from strategies.hf.architecture import hf_config_for

        self.config = config
        model = AutoModelForCausalLM.from_config(
            hf_config_for(config.model), attn_implementation="sdpa", dtype=torch.float32
        )
        initialize_parameters(model, config)
        mesh = init_device_mesh("cpu", (1,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        self.model = model
        opt = config.optimizer
        decay = [p for p in model.parameters() if p.dim() > 1]
        no_decay = [p for p in model.parameters() if p.dim() <= 1]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=opt.lr,
            betas=(opt.adam_beta1, opt.adam_beta2),
            eps=opt.adam_eps,
            weight_decay=opt.weight_decay,
        )

    def train_step(
        self, sequences: Sequence[Sequence[int]], loss_masks: Sequence[Sequence[float]]
    ) -> float:
        """One optimizer step on the batch; returns the batch's token-mean NLL."""
        size = self.config.micro_batch_size
        total_tokens = float(sum(sum(mask) for mask in loss_masks))
        self.optimizer.zero_grad(set_to_none=True)
        starts = range(0, len(sequences), size)
        total = 0.0
        for start in starts:
            rows, masks = sequences[start : start + size], loss_masks[start : start + size]
            width = max(len(row) for row in rows)
            ids = torch.zeros(len(rows), width, dtype=torch.long)
            attention = torch.zeros(len(rows), width, dtype=torch.bool)
            mask = torch.zeros(len(rows), width)
            for i, (row, row_mask) in enumerate(zip(rows, masks, strict=True)):
                ids[i, : len(row)] = torch.tensor(row)
                attention[i, : len(row)] = True
                mask[i, : len(row)] = torch.tensor(row_mask)
            self.model.set_requires_gradient_sync(start == starts[-1])
            logits = self.model(input_ids=ids, attention_mask=attention, use_cache=False).logits
            log_p = torch.log_softmax(logits.float(), dim=-1)
            picked = log_p[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
            loss = -(picked * mask[:, 1:]).sum() / total_tokens
            loss.backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.optimizer.clip_grad)
        self.optimizer.step()
        return total
