"""The model registry: HF architectures -> family (class + weight map), typed errors, and a new
family added at run time as one class plus one registry entry."""

from __future__ import annotations

import json

import pytest
import torch

from loraplex.engine.model import registry
from loraplex.engine.model.config import ModelConfig, ModelConfigError
from loraplex.engine.model.llama import LlamaForCausalLM, LlamaWeights
from loraplex.engine.model.loader import build_model, load_model
from loraplex.engine.model.protocol import CausalLM
from loraplex.engine.model.registry import ModelFamily, UnknownArchitectureError
from loraplex.engine.model_runner import ModelRunner, StepItem
from tests.helpers.models import TINY_CONFIG, make_tiny_model

FIELDS = dict(TINY_CONFIG, rms_norm_eps=1e-6)
FAMILIES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}


@pytest.mark.parametrize("arch", list(FAMILIES))
def test_registry_resolves_the_three_families(arch: str) -> None:
    cfg = ModelConfig.from_dict(dict(FIELDS, architectures=[arch], model_type=FAMILIES[arch]))
    assert cfg.architecture == arch
    assert registry.family(arch).model is LlamaForCausalLM
    model = build_model(cfg, max_loras=2, max_lora_rank=4)
    assert isinstance(model, LlamaForCausalLM) and isinstance(model, CausalLM)
    assert (model.max_loras, model.max_lora_rank) == (2, 4)
    assert model.layers[0].qkv_proj.lora_b is not None


def test_model_type_stands_in_for_missing_or_unregistered_architectures() -> None:
    assert ModelConfig.from_dict(dict(FIELDS, model_type="mistral")).architecture == (
        "MistralForCausalLM"
    )
    old = ModelConfig.from_dict(
        dict(FIELDS, architectures=["LLaMAForCausalLM"], model_type="llama")
    )
    assert old.architecture == "LlamaForCausalLM"


def test_unknown_architecture_is_a_typed_error(tmp_path) -> None:
    fields = dict(FIELDS, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    with pytest.raises(UnknownArchitectureError, match="GPT2LMHeadModel.*LlamaForCausalLM"):
        ModelConfig.from_dict(fields)
    (tmp_path / "config.json").write_text(json.dumps(fields))
    with pytest.raises(ModelConfigError, match="not supported"):  # the loader's error type too
        load_model(tmp_path, dtype=torch.float32, device="cpu")
    with pytest.raises(UnknownArchitectureError, match="Nope"):
        registry.family("Nope")
    with pytest.raises(UnknownArchitectureError, match="None"):
        ModelConfig.from_dict(FIELDS)  # neither architectures nor model_type


class FakeForCausalLM(LlamaForCausalLM):
    """A "new family": the Llama layer structure under another architecture name."""


FAKE = ModelFamily(FakeForCausalLM, LlamaWeights())


@pytest.fixture(params=["object", "lazy"])
def fake_family(request):
    registry.register(
        "FakeForCausalLM", "fake", FAKE if request.param == "object" else f"{__name__}:FAKE"
    )
    yield
    registry.unregister("FakeForCausalLM")


def test_a_family_registered_at_run_time_is_built_and_served(tmp_path, fake_family) -> None:
    base = make_tiny_model(tmp_path / "llama", seed=3)
    fake = make_tiny_model(tmp_path / "fake", seed=3)
    cfg = json.loads((fake / "config.json").read_text())
    cfg.update(architectures=["FakeForCausalLM"], model_type="fake")
    (fake / "config.json").write_text(json.dumps(cfg))
    assert "FakeForCausalLM" in registry.supported()

    model = load_model(fake, dtype=torch.float32, device="cpu")
    assert type(model) is FakeForCausalLM and model.cfg.architecture == "FakeForCausalLM"
    ref = load_model(base, dtype=torch.float32, device="cpu")
    assert type(ref) is LlamaForCausalLM
    items = [StepItem([5, 7, 9], 0, [0]), StepItem([3], 0, [1])]
    out = ModelRunner(model, num_blocks=4, block_size=4).execute(items)
    torch.testing.assert_close(out, ModelRunner(ref, num_blocks=4, block_size=4).execute(items))
