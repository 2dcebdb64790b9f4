"""LoRA fine-tuning: adapters, optimizer, gradient accumulation, rematerialization, checkpoint and resume."""
