"""The LM head's numeric kernels: log-probs, entropy and their gradients from logits
(vocab-parallel) or straight from the hidden states and the output weight (fused)."""
