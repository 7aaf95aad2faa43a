"""Model pieces both backends build with: (seed, name) weight draws, LoRA as peft defines it,
and causal attention over packed rows."""
