"""Command line: ``python -m engine demo | train | matrix``, its progress display and the demo."""

from engine.cli.main import main

__all__ = ["main"]
