"""composable-engine: one RL training Engine assembled from Head x Backend x DevicePlatform.

Importing this package is cheap: megatron-core, torch_npu and MindSpeed are imported only when
a part that needs them is used.
"""

from engine.config import CallSettings, EngineConfig
from engine.engine import Engine
from engine.registry import register_backend, register_device, register_head

__all__ = [
    "CallSettings",
    "Engine",
    "EngineConfig",
    "register_backend",
    "register_device",
    "register_head",
]
