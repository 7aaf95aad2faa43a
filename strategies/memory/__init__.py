"""Device memory: a model's parameters counted before it is built, and offload by storage."""
