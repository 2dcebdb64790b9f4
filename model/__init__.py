"""Flax models that load real checkpoints from local disk, with numerics equal to diffusers/transformers."""
