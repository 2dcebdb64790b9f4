"""Device meshes and placement rules: sequence, CFG and data parallel inference; FSDP and data parallel training.

`mesh.py`: the mesh of named axes (data, cfg, fsdp, seq, tensor), `--mesh` text, parameter and activation placement.
`attention.py`: Ulysses (all-to-all) and ring (ppermute) sequence-parallel attention through `jax.shard_map`.
`krea2.py`: the Krea 2 pipeline's denoising step on a mesh.
"""
