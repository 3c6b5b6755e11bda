"""Tensor parallelism for final-layout artifacts: plans, per-rank artifacts, bundles and group cohorts.

The package's public names are re-exported by `host_weight_runtime.diffusion`. Everything
that needs `torch.distributed` (cohort, apply, loader) is imported lazily; the core never
imports this package (C08).
"""
