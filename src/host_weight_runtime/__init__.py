"""host-weight-runtime: one immutable, hashed, memory-mapped weight artifact per node."""
