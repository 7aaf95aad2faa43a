"""Hugging Face checkpoints (Llama family) <-> megatron GPTModel: config, weights, export.

transformers and safetensors are imported inside functions only, so importing this package is
cheap.
"""
