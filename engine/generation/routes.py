"""The experts each generated position was routed to, per mixture-of-experts layer (what verl's
R3 replays in the trainer)."""

from __future__ import annotations

from typing import Any

import torch

from heads.errors import ConfigError


def is_moe(hf_config: Any) -> bool:
    """Whether a transformers config is a mixture-of-experts model's."""
    return bool(getattr(hf_config, "num_experts", 0) or getattr(hf_config, "num_local_experts", 0))


class RouteRecorder:
    """A forward hook on every ``mlp.gate`` (the indices it returns, or the top-k of its
    logits), kept per row: a prompt's positions, then each token fed back while its row
    generates."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.top_k = int(getattr(model.config, "num_experts_per_tok", 0) or 0)
        gates = [
            module
            for name, module in model.named_modules()
            if name.endswith("mlp.gate") and isinstance(module, torch.nn.Module)
        ]
        if not gates or self.top_k < 1:
            raise ConfigError(
                f"no router found in {type(model).__name__} (a mixture-of-experts model's "
                "mlp.gate modules, with num_experts_per_tok)"
            )
        self.records: list[torch.Tensor] = []
        self.prompt_lengths: list[int] = []
        self.kept: list[list[torch.Tensor]] = []
        for gate in gates:
            gate.register_forward_hook(self._hook)

    def start(self, prompt_lengths: list[int]) -> None:
        """A new batch of left-padded prompts of these lengths."""
        self.records, self.prompt_lengths = [], prompt_lengths
        self.kept = [[] for _ in prompt_lengths]

    def _hook(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if isinstance(output, tuple) and len(output) == 3:  # (logits, scores, indices)
            self.records.append(output[2])
        else:
            logits = output[0] if isinstance(output, tuple) else output
            self.records.append(torch.topk(logits.float(), self.top_k, dim=-1).indices)

    def keep(self, positions: int, first: bool, finished: list[bool]) -> None:
        """Keep the routes of the forward just run over ``positions`` per row: the prompt's
        (not its padding) at the ``first``, then the fed-back token of each row not
        ``finished``."""
        rows = len(self.kept)
        layers = [record.reshape(rows, positions, self.top_k) for record in self.records]
        self.records = []
        chosen = torch.stack(layers, dim=2)  # [rows, positions, layers, top_k]
        for row, kept in enumerate(self.kept):
            if first:
                kept.append(chosen[row, positions - self.prompt_lengths[row] :])
            elif not finished[row]:
                kept.append(chosen[row])

    def rows(self, generated: list[int]) -> list[torch.Tensor]:
        """Each row's routes ``[prompt + generated - 1, layers, top_k]``: the last token's are
        not computed (it is never fed back), as verl's R3 replays prompt + response minus one
        position."""
        return [
            torch.cat(kept)[: length + count - 1].to(torch.long)
            for kept, length, count in zip(self.kept, self.prompt_lengths, generated, strict=True)
        ]
