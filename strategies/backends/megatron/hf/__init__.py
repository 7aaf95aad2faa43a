"""Hugging Face weights <-> megatron GPTModel: the Llama-family state-dict adapter, streaming
loads into each rank's shard, export and saving. Config parsing and the safetensors reader are
backend-neutral (``strategies.hf``)."""
