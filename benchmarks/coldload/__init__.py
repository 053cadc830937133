"""``python -m benchmarks.coldload``: forwards to the cold-load study of the package.

The study ships as ``loraplex.engine.bench.coldload`` (``loraplex bench coldload``); this
package keeps the source-checkout command line and the names other benchmarks import.
"""
