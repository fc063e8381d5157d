"""Benchmarks: each prints a table of numbers measured in one run (`python -m bench.NAME`)."""
