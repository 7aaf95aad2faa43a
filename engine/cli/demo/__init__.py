"""``python -m engine demo``: PPO with actor, critic and reference engines on the parity task."""

from engine.cli.demo.loop import Interrupted, run
from engine.cli.demo.settings import DemoConfig, resolve_config

__all__ = ["DemoConfig", "Interrupted", "resolve_config", "run"]
