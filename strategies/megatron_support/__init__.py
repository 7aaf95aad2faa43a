"""megatron-core support for the megatron backend and the CPU platform: the tested release range,
imports without its fallback notices, and its CPU compatibility layer."""
