"""Megatron-core backend: parallel_state mesh, GPTModel, megatron DDP + optimizer, schedules."""
