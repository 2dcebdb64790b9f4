"""Device meshes and placement rules: sequence, CFG and data parallel inference; FSDP and data parallel training."""
