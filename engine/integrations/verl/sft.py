"""verl's SFT trainer on this engine where verl's own entry point cannot start (CPU hosts).

    torchrun --nproc-per-node 2 -m engine.integrations.verl.sft \\
        model.path=DIR data.train_files=FILE engine.strategy=fsdp2 trainer.device=cpu ...

Takes the overrides of ``python -m verl.trainer.sft_trainer`` (verl's hydra config
``sft_trainer_engine``) and does what its ``main`` does, ``SFTTrainer(config).fit()``
(verl/trainer/sft_trainer.py, unmodified), except that it creates the process group itself:
verl's asks torch for the backend ``"cpu:gloo,<device>:<backend>"``, which on a CPU platform is
``"cpu:gloo,cpu:gloo"``, and torch refuses a device type named twice
(verl/trainer/sft_trainer.py:455 -> verl/utils/distributed.py:63). Here each device type is
named once.
"""

from __future__ import annotations

import os
from typing import Any

import hydra


@hydra.main(
    config_path="pkg://verl.trainer.config", config_name="sft_trainer_engine", version_base=None
)
def main(config: Any) -> None:
    import torch.distributed as dist
    from verl.trainer.sft_trainer import SFTTrainer
    from verl.utils.device import auto_set_device, get_torch_device
    from verl.utils.distributed import destroy_global_process_group

    from engine.integrations.verl.platform import process_group_backend

    auto_set_device(config)
    if not dist.is_initialized():
        dist.init_process_group(backend=process_group_backend())
        get_torch_device().set_device(int(os.environ.get("LOCAL_RANK", "0")))
    SFTTrainer(config=config).fit()
    destroy_global_process_group()


if __name__ == "__main__":
    main()
