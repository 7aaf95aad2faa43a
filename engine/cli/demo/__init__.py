"""``python -m engine demo``: PPO with actor, critic and reference engines on the parity task."""

from engine.cli.demo.config import DemoConfig, resolve_config
from engine.cli.demo.loop import Interrupted, run

__all__ = ["DemoConfig", "Interrupted", "resolve_config", "run"]
