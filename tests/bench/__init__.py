"""Tests of the benchmark studies shipped in the package (loraplex.engine.bench)."""
