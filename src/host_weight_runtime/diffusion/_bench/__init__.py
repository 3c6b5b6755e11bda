"""hwr bench: side-by-side load benchmarks (application layer, private)."""
