"""Benchmarks: ``python3 benchmarks/run.py`` runs them all (see its docstring)."""
