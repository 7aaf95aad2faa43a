"""Device platforms (one file each): cpu, cuda, npu; the CPU compatibility layer for megatron."""
