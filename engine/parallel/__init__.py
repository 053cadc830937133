"""Tensor parallelism in the engine: rank 0 (this process) and its worker processes.

``group``: the workers, their connections and liveness (rank 0's side); ``worker``: a worker
process; ``runner``: rank 0's ``ModelRunner`` that sends each step and slot write to the
workers. The model side (what each rank holds, the collectives) is ``model/tp.py``.
"""

from __future__ import annotations

from loraplex.engine.parallel.group import WorkerGroup
from loraplex.engine.parallel.runner import ParallelRunner

__all__ = ["ParallelRunner", "WorkerGroup"]
