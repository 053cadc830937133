"""Adapter helpers shared by the registry, scheduler and adapter-form tests.

- a registry over a fake loader (``FakeLoader``, ``make_manager``) and versions put in place
  without loads: ``register_version``, ``loaded`` (CPU tier), ``in_slot`` (slot written and
  landed), ``settle`` (let a load task end);
- adapter folders: ``make_dora_adapter`` (DoRA with magnitudes off their initial norms),
  ``boost_added_rows`` / ``resized_base`` (an adapter that added tokens, and PEFT's base for it).
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import torch
from safetensors.torch import load_file, save_file

from loraplex.engine.adapters.registry import AdapterRegistry, AdapterState, AdapterVersion
from loraplex.engine.adapters.slot_store import SlotStore
from tests.helpers.models import copy_adapter, make_peft_adapter
from tests.helpers.slots import FakeWriter, land


class FakeLoader:
    """The manager's async loader: each call waits until the test ends it (``finish``)."""

    def __init__(self) -> None:
        self.calls: list[AdapterVersion] = []
        self._gates: dict[int, asyncio.Future] = {}

    async def __call__(self, v: AdapterVersion) -> None:
        self.calls.append(v)
        gate = asyncio.get_running_loop().create_future()
        self._gates[id(v)] = gate
        await gate  # raises the error ``finish`` set
        v.adapter = SimpleNamespace(rank=4, nbytes=1000, dora=None)

    async def finish(self, v: AdapterVersion, error: BaseException | None = None) -> None:
        """End ``v``'s running load (with ``error``: it fails) and let the manager see it."""
        task = v.load_task
        assert task is not None, f"no load of {v.key} runs"
        await asyncio.sleep(0)  # the task reaches the loader
        gate = self._gates.pop(id(v))
        if error is None:
            gate.set_result(None)
        else:
            gate.set_exception(error)
        await settle(task)


async def settle(task: asyncio.Task) -> None:
    """Let ``task`` end (bounded: a bug that keeps it running fails the test, not hangs it)."""
    await asyncio.wait([task], timeout=5.0)
    assert task.done(), "the load task is still running"


def make_manager(max_loras: int = 2, max_cpu_loras: int = 3, **kw) -> AdapterRegistry:
    kw.setdefault("loader", FakeLoader())
    slots = SlotStore(max_loras, kw.get("max_full", 0), writer=FakeWriter())
    return AdapterRegistry(max_loras=max_loras, max_cpu_loras=max_cpu_loras, slots=slots, **kw)


def register_version(
    m: AdapterRegistry, name: str, digest: str | None = None, **kw
) -> AdapterVersion:
    v = m.new_version(name, f"file:///adapters/{name}", **kw)
    v.digest = digest or f"sha-{name}"
    return m.register(v)


def loaded(m: AdapterRegistry, name: str, *, last_used: float = 0.0, **kw) -> AdapterVersion:
    """A registered version already in the CPU tier (as a finished load leaves it)."""
    v = register_version(m, name, **kw)
    m._set_state(v, AdapterState.CPU)  # (the registry's indices follow its states)
    v.adapter = SimpleNamespace(rank=4, nbytes=1000, dora=None)
    v.last_used = last_used
    return v


def in_slot(m: AdapterRegistry, name: str, *, last_used: float = 0.0, **kw) -> AdapterVersion:
    """A CPU-tier version whose slot write has landed (what the engine's poll does)."""
    v = loaded(m, name, **kw)
    assert m.slots.assign(v) is not None
    land(m.slots, v)
    v.last_used = last_used  # the assignment touched it
    return v


def make_dora_adapter(model_dir, out, *, seed=0, **kw):
    """A PEFT DoRA adapter whose magnitudes are moved off their initial row norms (so that
    the row scale g = m / ||W + s B A|| differs from 1 everywhere)."""
    raw = make_peft_adapter(model_dir, out.with_name(out.name + "-raw"), seed=seed,
                            use_dora=True, **kw)  # fmt: skip
    tensors = load_file(raw / "adapter_model.safetensors")
    g = torch.Generator().manual_seed(seed)
    for k, t in tensors.items():
        if "lora_magnitude_vector" in k:
            tensors[k] = t * (1 + 0.3 * torch.rand(t.shape, generator=g))
    return copy_adapter(raw, out, tensors=tensors)


def boost_added_rows(folder, vocab=256):
    """Scale the added tokens' LM head rows up, so that greedy decoding picks them at times."""
    path = folder / "adapter_model.safetensors"
    t = load_file(path)
    for key in (
        "base_model.model.lm_head.weight",
        "base_model.model.lm_head.modules_to_save.weight",
    ):
        t[key][vocab:] *= 6.0
    save_file(t, path)


def resized_base(model_dir, out, rows):
    """The base resized to ``rows`` tokens (PEFT's oracle for an adapter that added tokens)."""
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    base.resize_token_embeddings(rows, mean_resizing=False)
    base.save_pretrained(out)
    return out
