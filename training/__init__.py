"""LoRA fine-tuning: adapters, optimizer, gradient accumulation, rematerialization, checkpoint and resume.

`lora.py`: adapters on the Linear layers (targets by module path), merge/unmerge, quantized frozen base, save/load in
diffusers' key names. `data.py`: captioned-image folders, aspect-ratio buckets, the latent/text cache, batch order.
`train.py`: the flow-matching step and the training loop with orbax checkpoints (`scripts/train_lora.py` is its CLI).
"""
