"""The benchmarks behind `scripts/benchmark.py`: `timing` (clocks, energy, CUPTI), `rows` (result rows, subprocesses,
tables), `inputs` (configurations, inputs, FLOPs), and a module per subject. Heavy imports (jax, torch, diffusers)
happen inside the functions that need them."""
