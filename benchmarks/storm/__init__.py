"""Cold-load storm: do running streams keep their pace while a burst of adapters loads?

Scenario (issue "storm-proof loads"): ``--streams`` requests decode steadily on the base model
and ``--resident`` adapters; then, for each storm size N in ``--storms``, N new adapters
(distinct files, local source) are registered at once with ``add_adapter`` (fetch + sha256 +
preflight), and then one short request is sent on each of them at once (stage, slot write,
prefill). The running streams' inter-token gaps are measured per window (quiet, registration,
requests, after), next to the asyncio loop's lag, Triton compiles and the storm requests' TTFT
split by load stage.

    python -m benchmarks.storm                      # H200: Llama-3-8B shape, 32 streams, 24 + 64
    python -m benchmarks.storm --smoke              # CPU: tiny model, a few seconds
    python -m benchmarks.storm --shape qwen3-30b-a3b --layers 24 --storms 8
                                                    # MoE: adapters on attention + every expert
    python -m benchmarks.storm --storms --sustained 150 4 --max-cpu-loras 128
                                                    # 150 registrations/s for 4 s, no requests
                                                    # (sustained.py: the loads' own ceiling)

Gaps are measured where a client sees them: the time between two consecutive outputs of one
stream, read by the stream's consumer on the event loop.
"""

from __future__ import annotations

from benchmarks.storm.cli import main
from benchmarks.storm.report import plot_timeline, table
from benchmarks.storm.run import run

__all__ = ["main", "run", "table", "plot_timeline"]
