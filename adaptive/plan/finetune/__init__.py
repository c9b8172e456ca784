"""Fine-tuning a downloaded checkpoint: the method (full, LoRA, QLoRA) and what it makes of each parameter."""
