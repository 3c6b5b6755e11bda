"""hwr bench: side-by-side load benchmarks (tooling, not public API)."""
