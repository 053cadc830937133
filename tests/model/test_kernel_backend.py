"""The kernel-backend selector: names -> switches, the config field, and what the runner runs."""

from __future__ import annotations

import pytest
import torch

from loraplex.engine.config import EngineConfig
from loraplex.engine.model.backend import KERNEL_BACKENDS, KernelBackend, resolve_kernel_backend
from loraplex.engine.model.loader import load_model
from loraplex.engine.model_runner import ModelRunner
from tests.helpers.models import make_tiny_model


def test_names_resolve_per_device(monkeypatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # (Triton on CPU tensors: the interpreter)
    assert resolve_kernel_backend("auto", "cpu") == KernelBackend(fused=False, triton=False)
    assert resolve_kernel_backend("auto", "cuda") == KernelBackend(fused=True, triton=True)
    for device in ("cpu", "cuda"):
        assert resolve_kernel_backend("fused", device) == KernelBackend(fused=True, triton=True)
        assert resolve_kernel_backend("sgmv", device) == KernelBackend(fused=False, triton=True)
        assert resolve_kernel_backend("torch", device) == KernelBackend(fused=False, triton=False)
    twins = KernelBackend(fused=True, triton=False)
    assert resolve_kernel_backend(twins, "cpu") is twins
    with pytest.raises(ValueError, match="triton"):
        resolve_kernel_backend("triton", "cpu")


def test_triton_backends_on_cpu_need_the_interpreter(monkeypatch) -> None:
    """Without TRITON_INTERPRET a Triton backend on the CPU is refused when the runner is made
    (its first launch on CPU tensors would fail a step of a serving engine)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    for name in ("fused", "sgmv"):
        with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
            resolve_kernel_backend(name, "cpu")
        assert resolve_kernel_backend(name, "cuda").triton  # (no tensors needed to say so)
    assert resolve_kernel_backend("auto", "cpu") == KernelBackend(fused=False, triton=False)
    assert resolve_kernel_backend("torch", "cpu") == KernelBackend(fused=False, triton=False)
    twins = KernelBackend(fused=True, triton=False)  # the fused forward with torch twins
    assert resolve_kernel_backend(twins, "cpu") is twins


def test_config_field() -> None:
    assert EngineConfig().kernel_backend == "auto"
    for name in KERNEL_BACKENDS:
        assert EngineConfig(kernel_backend=name).kernel_backend == name
    with pytest.raises(ValueError, match="kernel_backend"):
        EngineConfig(kernel_backend="cuda")


def test_serve_flag() -> None:
    from loraplex.engine.server.cli import build_parser
    from loraplex.engine.server.launch import config_from_args

    parse = build_parser().parse_args
    assert config_from_args(parse(["serve"])).kernel_backend == "auto"
    cfg = config_from_args(parse(["serve", "--kernel-backend", "sgmv"]))
    assert cfg.kernel_backend == "sgmv"
    with pytest.raises(SystemExit):
        parse(["serve", "--kernel-backend", "cuda"])
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]  # the flag's choices
    (flag,) = [a for a in serve._actions if "--kernel-backend" in a.option_strings]
    assert tuple(flag.choices) == KERNEL_BACKENDS


@pytest.mark.parametrize("name", ["auto", "torch", "sgmv", "fused"])
def test_runner_takes_the_backend(tmp_path, name: str) -> None:
    model = load_model(make_tiny_model(tmp_path), dtype=torch.float32, device="cpu", max_loras=2)
    runner = ModelRunner(model, num_blocks=4, block_size=4, kernel_backend=name)
    fused = name == "fused"
    assert runner.fused == fused and runner.backend.triton == (name in ("sgmv", "fused"))
    assert runner.graphs is None  # CPU
    assert model.layers[0].qkv_proj.base_transposed == (not fused)  # CPU layout: reference only
