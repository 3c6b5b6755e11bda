"""Tooling behind `hwr demo`, `hwr bench` and the tests; not public API.

Benchmarks, demos and synthetic diffusers models live here, apart from the product's
adapters. They use the product only through its public API (C08).
"""
