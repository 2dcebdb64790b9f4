"""LoRA fine-tuning: adapters, optimizer, gradient accumulation, rematerialization, checkpoint and resume.

`lora.py`: adapters added to the Linear layers by target (module path patterns), merge/unmerge, quantized frozen base,
save/load in diffusers' key names (the adapter itself and other tools' LoRA files: `model/lora.py`,
`model/lora_files.py`). `data.py`: captioned-image folders, aspect-ratio buckets, the latent/text cache, batch order.
`train.py`: the flow-matching step and the training loop with orbax checkpoints (`scripts/train_lora.py` is its CLI).
"""
