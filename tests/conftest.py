"""Suite-wide settings: GPU tests are skipped without CUDA; Triton is interpreted on CPU."""

from __future__ import annotations

import os

import pytest
import torch

# assertions inside the shared helper modules get pytest's full failure report too
pytest.register_assert_rewrite(
    "tests.helpers", "tests.robustness.adapter_fixtures", "tests.robustness.server_fixtures",
)  # fmt: skip

# fixtures shared across folders, defined once: the engine tests' tiny model and adapters, a
# fake Hugging Face Hub, moto's S3 server
pytest_plugins = ["tests.helpers.fixtures", "tests.helpers.fake_hub", "tests.helpers.fake_s3"]

if not torch.cuda.is_available():
    # Triton kernels run on the CPU through the interpreter (set before triton is imported).
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
