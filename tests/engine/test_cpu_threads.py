"""A CPU engine leaves a core to its event loop: torch's intra-op threads default to one fewer
than the machine's cores (never more than torch already used); ``cpu_threads`` sets them."""

from __future__ import annotations

import os

import pytest
import torch

from loraplex.engine.startup import set_cpu_threads


@pytest.fixture(autouse=True)
def keep_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_default_leaves_a_core():
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    n = set_cpu_threads(None)
    assert n == max(1, (os.cpu_count() or 1) - 1)


def test_default_never_raises_what_the_app_chose():
    torch.set_num_threads(1)
    assert set_cpu_threads(None) == 1


def test_explicit_count():
    assert set_cpu_threads(1) == 1
