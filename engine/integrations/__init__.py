"""Integrations with RL frameworks; each imports its framework lazily, only inside its package."""
