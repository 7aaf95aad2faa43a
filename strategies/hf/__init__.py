"""Hugging Face checkpoints, backend-neutral: ``config.json`` -> ``ModelConfig``, the
safetensors reader, and the metadata written next to exported weights. Each backend owns only
its state-dict adapter. transformers and safetensors are imported inside functions only."""
