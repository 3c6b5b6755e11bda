"""Tooling behind `hwr demo`, `hwr bench`, `make soak` and the tests; a package of its own, not the runtime.

Benchmarks (the harness in `bench`, targeted measurements in `studies`), the soak, demos, synthetic
diffusers models and per-mapping memory live here, outside the `host_weight_runtime` import tree, so a
worker imports only the runtime. They use the runtime only through its public API (C08).
"""
