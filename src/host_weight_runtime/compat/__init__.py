"""Compatibility rooms: other runtimes' public APIs as thin translations onto this one.

`vllm_omni` presents vLLM-Omni's reference Host Weight Runtime (0.30.0) and can stand in for it
(`install()`). The core never imports this package.
"""
