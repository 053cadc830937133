"""Per-device kernel buffers (engine/model/kernels/workspace.py): made once per device."""

from __future__ import annotations

import pytest
import torch

from loraplex.engine.model.kernels.workspace import per_device


def test_made_once_per_device():
    cache: dict = {}
    made = []

    def make(d: torch.device) -> torch.Tensor:
        made.append(d)
        return torch.zeros(3, device=d)

    a = per_device(cache, "cpu", make, "prepare_x")
    b = per_device(cache, torch.device("cpu"), make, "prepare_x")
    assert a is b and made == [torch.device("cpu")] and list(cache) == [torch.device("cpu")]


@pytest.mark.gpu
def test_cuda_is_the_current_device():
    cache: dict = {}
    t = per_device(cache, "cuda", lambda d: torch.zeros(1, device=d), "prepare_x")
    assert per_device(cache, f"cuda:{torch.cuda.current_device()}", None, "prepare_x") is t
    assert list(cache) == [torch.device("cuda", torch.cuda.current_device())]
