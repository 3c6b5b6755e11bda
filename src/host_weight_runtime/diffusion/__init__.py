"""Typed diffusion adapters for runtime-ready final-layout artifacts."""
