"""Benchmarks for hoplite-gpu. Entry point: ``python -m benchmarks``."""
