"""Random-weight models and PEFT adapters for the GPU benchmarks of a source checkout.

The code ships in the package as ``loraplex.engine.bench.synthetic``; this module re-exports it.
"""

from __future__ import annotations

from loraplex.engine.bench.synthetic import (
    LLAMA3_8B,
    random_model,
    write_adapter,
    write_model_config,
)

__all__ = ["LLAMA3_8B", "random_model", "write_adapter", "write_model_config"]
