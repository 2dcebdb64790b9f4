"""The layer between the Pallas kernels and the models: which attention kernel and which GEMM path run, chosen per
device and precision in one place.

`names`: the attention kernels and weight precisions by name (importable without jax, for the command lines);
`attention`: the attention a model calls; `linear`: the linear layers' products and the FP8 activation producers;
`kernels`: the kernel entry points under their own jit."""
