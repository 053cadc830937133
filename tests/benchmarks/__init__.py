"""Tests of the benchmarks/ studies."""
