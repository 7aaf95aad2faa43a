"""What every backend's checkpoint files share: directories published whole with checksummed
files, staged DCP saves, the RNG streams, and resuming with the loading engine's settings."""
