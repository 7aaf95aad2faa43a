"""Backends (how a model is parallelised and stepped) and device platforms (where it runs)."""
