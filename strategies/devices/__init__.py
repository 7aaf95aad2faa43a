"""Device platforms (one file each): cpu, cuda, npu."""
