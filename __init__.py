"""mxdit: image diffusion transformers in JAX/XLA, on low-precision formats, with Pallas kernels."""
