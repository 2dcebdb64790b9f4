"""Pallas GPU kernels (block-scaled GEMM, INT8-QK attention), each beside its plain-jnp reference."""
