"""A bench-only Django project: one handler that writes one row, behind each package.

Every protected view, ours and the peers', wraps the same
:func:`~benchmarks.bench.views.write_order`, so the figures differ only by
what each package adds around it.
"""
