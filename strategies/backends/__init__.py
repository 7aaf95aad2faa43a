"""Backends: mesh, model build, micro-batch schedule, optimizer (one package each)."""
