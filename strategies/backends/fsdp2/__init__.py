"""The FSDP2 backend: Hugging Face transformers causal LMs sharded over data-parallel ranks with
``torch.distributed.fsdp.fully_shard``, trained with AdamW, checkpointed with
``torch.distributed.checkpoint``. torch.distributed's FSDP and transformers are imported inside
functions only."""
