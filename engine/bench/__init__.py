"""Benchmark studies shipped with the package: ``loraplex bench <study>``.

Install the ``bench`` extra (``pip install -e '.[bench]'`` in a checkout) for plots, progress bars and
the S3 source. The studies use the engine's public API and its model; the ``loraplex``
command registers them, and nothing below ``loraplex.engine.server`` imports them.

- ``coldload``: cold-load latency study (docs/coldload.md).
- ``synthetic``: random-weight models and PEFT adapter folders (no checkpoints needed).
"""
