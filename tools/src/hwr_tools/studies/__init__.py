"""Targeted measurements beside `hwr bench`, one runnable module each (`python -m hwr_tools.studies.NAME`).

Each times a few rows of the benchmark in minutes instead of the whole run; benchmarks/README.md gives
their figures and the commands that produced them.
"""
