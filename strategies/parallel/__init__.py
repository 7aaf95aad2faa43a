"""Collectives every part uses, and the sequence splits of context and Ulysses parallelism."""
