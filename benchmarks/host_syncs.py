"""Host syncs per training step on a CUDA device, counted by CUDA itself.

``torch.cuda.set_sync_debug_mode("warn")`` makes every operation that waits for the device
(``.item()``, ``float(tensor)``, ``bool(tensor)``, a device-to-host copy, a boolean-mask index,
``nonzero``...) issue a warning; this counts them over one ``train_batch`` after a warm-up step,
per backend, for a PPO actor step and a critic step, with the code location of each. The engine
aims at one (the fetch of the step's numbers); the test suite checks the same on the CPU by
recording reads of device values (tests/engine/test_host_syncs.py).

    python -m benchmarks.host_syncs [--device cuda] [--backend megatron fsdp2] [--packing]
        [--fused-min-logits 0]
"""

from __future__ import annotations

import argparse
import collections
import traceback
import warnings
from typing import Any

import torch


def count_syncs(
    backend: str,
    head: str,
    device: str,
    packing: bool = False,
    lm_head: dict[str, Any] | None = None,
) -> tuple[int, collections.Counter[str]]:
    from engine import Engine
    from engine.losses import ActorLoss, CriticLoss
    from strategies.backends.megatron.mesh import destroy_mesh
    from tests.engine.test_host_syncs import lm_batch
    from tests.factories import tiny_model

    destroy_mesh()
    engine = Engine.build(
        head=head,
        backend=backend,
        device=device,
        config={
            "model": tiny_model(),
            "micro_batch_size": 2,
            "optimizer": {"clip_grad": 1.0},
            "packing": packing,
            **({"head": {"compute_entropy": True, **(lm_head or {})}} if head == "lm" else {}),
        },
    ).initialize()
    batch = lm_batch(1)
    if head == "lm":
        loss: Any = ActorLoss(kl_coeff=0.1, entropy_coeff=0.01)
    else:
        batch["values"] = batch["old_log_probs"]
        batch["returns"] = batch["advantages"]
        loss = CriticLoss()
    sites: collections.Counter[str] = collections.Counter()
    with engine.train_mode():
        engine.train_batch(lm_batch(0) if head == "lm" else batch, loss)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:  # the step's alone
                warnings.simplefilter("always")
                engine.train_batch(batch, loss)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    for warning in caught:
        if "synchroniz" in str(warning.message):
            sites[f"{warning.filename}:{warning.lineno}"] += 1
    destroy_mesh()
    return sum(sites.values()), sites


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--backend", nargs="+", default=["megatron", "fsdp2"])
    parser.add_argument("--packing", action="store_true", help="packed micro-batches")
    parser.add_argument(
        "--fused-min-logits",
        type=int,
        help="the LM head's fused_min_logits (0: its tile loops run, the gradient in forward "
        "with the PPO loss; default: tiny's small logits are computed whole)",
    )
    args = parser.parse_args()
    lm_head = {} if args.fused_min_logits is None else {"fused_min_logits": args.fused_min_logits}
    if not torch.cuda.is_available():
        raise SystemExit("host_syncs needs a CUDA device (torch.cuda.is_available() is False)")
    for backend in args.backend:
        for head in ("lm", "value"):
            try:
                total, sites = count_syncs(backend, head, args.device, args.packing, lm_head)
            except Exception:  # report and go on to the next cell
                print(f"{backend} {head}: failed\n{traceback.format_exc(limit=4)}")
                continue
            layout = "packed" if args.packing else "padded"
            print(f"{backend} {head} ({layout}): {total} host sync(s) in one train_batch")
            for site, count in sites.most_common():
                print(f"    {count} x {site}")


if __name__ == "__main__":
    main()
