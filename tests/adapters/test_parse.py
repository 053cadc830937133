"""PEFT adapter folders: config parsing, PEFT-exact matching, loading, and every rejection."""

from __future__ import annotations

import builtins
import io
import json
import math
import pickle
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from loraplex.engine.adapters.parse import base_module_name, load_adapter
from loraplex.engine.adapters.peft_config import parse_peft_config
from loraplex.engine.errors import (
    AdapterConfigError,
    AdapterFormatError,
    AdapterNotFoundError,
    AdapterRankError,
    AdapterShapeError,
    AdapterTargetError,
)
from loraplex.engine.model.config import LORA_MODULES, ModelConfig
from tests.helpers.models import (
    ALL_MODULES,
    ATTN_MODULES,
    copy_adapter,
    make_peft_adapter,
    make_tiny_model,
    peft_lora_weights,
    write_adapter,
)

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

MAX_RANK = 64
Q0_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
Q0_B = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"

CASES = {
    "list": dict(r=8, alpha=16, target_modules=ALL_MODULES),
    "regex": dict(r=4, alpha=8, target_modules=r".*\.(q_proj|v_proj|up_proj|down_proj)"),
    "patterns": dict(
        r=8,
        alpha=16,
        target_modules=ALL_MODULES,
        rank_pattern={"down_proj": 6, "model.layers.1.self_attn.q_proj": 2},
        alpha_pattern={"v_proj": 48, r"layers\.0\.mlp\.up_proj": 3},
    ),
    "rslora": dict(r=16, alpha=32, use_rslora=True, target_modules=("q_proj", "v_proj")),
    "layers": dict(r=4, alpha=4, target_modules=ATTN_MODULES, layers_to_transform=[1]),
    "layers_pattern": dict(
        r=4, alpha=4, target_modules=["gate_proj"], layers_to_transform=0, layers_pattern="layers"
    ),
    "exclude": dict(
        r=4, alpha=4, target_modules=ALL_MODULES, exclude_modules=["model.layers.0.mlp.down_proj"]
    ),
}


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("adapters")


@pytest.fixture(scope="module")
def base(root: Path) -> Path:
    return make_tiny_model(root / "base", kind="llama", seed=3)


@pytest.fixture(scope="module")
def mc(base: Path) -> ModelConfig:
    return ModelConfig.from_dir(base)


@pytest.fixture(scope="module")
def adapters(root: Path, base: Path) -> dict[str, Path]:
    return {
        name: make_peft_adapter(base, root / name, seed=i, **kw)
        for i, (name, kw) in enumerate(CASES.items())
    }


@pytest.fixture(scope="module")
def plain(adapters: dict[str, Path]) -> Path:
    return adapters["list"]


# ---------------------------------------------------------------- loading real adapters


@pytest.mark.parametrize("case", list(CASES))
def test_peft_adapters_load_equal_to_peft(case, adapters, base, mc):
    adapter = load_adapter(adapters[case], mc, max_lora_rank=MAX_RANK)
    expected = peft_lora_weights(base, adapters[case])
    assert set(adapter.weights) == set(expected)
    for key, (a, b) in expected.items():
        w = adapter.weights[key]
        assert w.a.dtype == w.b.dtype == torch.float32
        assert w.a.is_contiguous() and w.b.is_contiguous() and w.a.device.type == "cpu"
        torch.testing.assert_close(w.a, a, rtol=0, atol=0)
        torch.testing.assert_close(w.b, b, rtol=1e-7, atol=0)
    assert adapter.rank == max(a.shape[0] for a, _ in expected.values())
    assert adapter.nbytes == sum(a.nbytes + b.nbytes for a, b in expected.values())
    assert adapter.name == case and adapter.path == str(adapters[case])


def test_patterns_and_rslora_scales(adapters, mc):
    cfg = load_adapter(adapters["patterns"], mc, max_lora_rank=MAX_RANK).config
    assert cfg.rank_for("model.layers.1.self_attn.q_proj") == 2
    assert cfg.rank_for("model.layers.0.self_attn.q_proj") == 8
    assert cfg.rank_for("model.layers.0.mlp.down_proj") == 6
    assert cfg.scale_for("model.layers.1.self_attn.v_proj") == 48 / 8
    assert cfg.scale_for("model.layers.0.mlp.up_proj") == 3 / 8
    assert cfg.scale_for("model.layers.1.mlp.up_proj") == 16 / 8
    rs = load_adapter(adapters["rslora"], mc, max_lora_rank=MAX_RANK).config
    assert rs.scale_for("model.layers.0.self_attn.q_proj") == 32 / math.sqrt(16)


def test_dtype_cast_after_folding_scale(plain, mc):
    ref = load_adapter(plain, mc, max_lora_rank=MAX_RANK)
    half = load_adapter(plain, mc, max_lora_rank=MAX_RANK, dtype=torch.bfloat16, name="x")
    assert half.name == "x"
    for key, w in half.weights.items():
        assert w.a.dtype == w.b.dtype == torch.bfloat16
        assert torch.equal(w.b, ref.weights[key].b.to(torch.bfloat16))
    assert half.nbytes * 2 == ref.nbytes


def test_adapter_name_inside_keys(plain, tmp_path, mc):
    tensors = {
        k.replace(".lora_A.", ".lora_A.default.").replace(".lora_B.", ".lora_B.default."): v
        for k, v in load_file(plain / "adapter_model.safetensors").items()
    }
    named = copy_adapter(plain, tmp_path / "named_keys", tensors=tensors)
    got = load_adapter(named, mc, max_lora_rank=MAX_RANK).weights
    ref = load_adapter(plain, mc, max_lora_rank=MAX_RANK).weights
    assert set(got) == set(ref)
    assert all(torch.equal(got[k].b, ref[k].b) for k in ref)


# ---------------------------------------------------------------- PEFT matching rules


MATCH_CONFIGS = [
    dict(target_modules=["q_proj", "mlp.up_proj"]),
    dict(target_modules=["model.layers.1.self_attn.k_proj", "v_proj"], layers_to_transform=[0]),
    dict(target_modules=r".*layers\.1\..*_proj"),
    dict(target_modules=["gate_proj"], layers_to_transform=1, layers_pattern=["layers"]),
    dict(target_modules=["o_proj", "down_proj"], exclude_modules=r".*\.0\..*"),
    dict(target_modules=["self_attn.q_proj"], layers_to_transform=[]),
]
NAMES = [base_module_name(i, m) for i in range(3) for m in LORA_MODULES]
NAMES += ["lm_head", "model.embed_tokens", "model.layers.0.self_attn"]


@pytest.mark.parametrize("kw", MATCH_CONFIGS)
def test_targets_match_peft(kw):
    from peft.tuners.tuners_utils import check_target_module_exists

    ref = peft.LoraConfig(r=4, **kw)
    raw = json.loads(json.dumps({**ref.to_dict(), **kw}))  # lists, as save_pretrained writes
    ours = parse_peft_config(raw)
    for name in NAMES:
        assert ours.targets(name) == bool(check_target_module_exists(ref, name)), name


def test_pattern_keys_match_peft():
    from peft.utils.other import get_pattern_key

    # NOTE: ".*_proj" matches every module, so only first-match-in-order gives PEFT's answer.
    ranks = {"layers.1.mlp.down_proj": 3, "q_proj": 5, r"layers\.\d\.self_attn\.k_proj": 7}
    ranks[r".*_proj"] = 9
    raw = {"peft_type": "LORA", "r": 8, "lora_alpha": 8, "target_modules": ".*"}
    cfg = parse_peft_config({**raw, "rank_pattern": ranks})
    for name in NAMES:
        assert cfg.rank_for(name) == ranks.get(get_pattern_key(ranks.keys(), name), 8), name


def test_defaults_written_by_peft_parse():
    raw = peft.LoraConfig(target_modules=["q_proj"]).to_dict()
    raw["target_modules"] = sorted(raw["target_modules"])
    cfg = parse_peft_config(json.loads(json.dumps(raw, default=str)))
    assert (cfg.r, cfg.lora_alpha, cfg.use_rslora, cfg.target_modules) == (
        8,
        8.0,
        False,
        ("q_proj",),
    )
    assert cfg.layers_to_transform is None and cfg.rank_pattern == {}


# ---------------------------------------------------------------- rejections


CONFIG_REJECTS = [
    ("use_dora", "yes"),
    ("modules_to_save", ["lm_head"]),
    ("bias", "lora_only"),
    ("fan_in_fan_out", True),
    ("peft_type", "IA3"),
    ("peft_type", None),
    ("use_qalora", True),
    ("lora_bias", True),
    ("r", None),
    ("r", 0),
    ("r", "8"),
    ("r", True),
    ("lora_alpha", None),
    ("lora_alpha", "16"),
    ("lora_alpha", float("inf")),
    ("rank_pattern", {"q_proj": -1}),
    ("target_modules", "(unclosed"),
]


@pytest.mark.parametrize(("field", "value"), CONFIG_REJECTS)
def test_config_rejections(field, value, plain, tmp_path, mc):
    bad = copy_adapter(plain, tmp_path / "bad", **{field: value})
    with pytest.raises(AdapterConfigError, match=field) as e:
        load_adapter(bad, mc, max_lora_rank=MAX_RANK)
    assert e.value.field is not None and field in e.value.field


def test_unknown_keys_and_init_values_ignored(plain, tmp_path, mc):
    odd = copy_adapter(plain, tmp_path / "odd", init_lora_weights="gaussian", future_key={"x": 1})
    assert load_adapter(odd, mc, max_lora_rank=MAX_RANK).weights


class _Bomb:
    """Unpickling this calls _detonate, which records that the file was unpickled."""

    fired = False

    def __reduce__(self):
        return (_detonate, ())


def _detonate() -> None:
    _Bomb.fired = True


@pytest.mark.parametrize("filename", ["adapter_model.bin", "adapter_model.pt", "weights.pth"])
def test_pickle_only_folder_is_refused_unopened(filename, plain, tmp_path, mc, monkeypatch):
    folder = tmp_path / "pickle"
    folder.mkdir()
    (folder / "adapter_config.json").write_text((plain / "adapter_config.json").read_text())
    (folder / filename).write_bytes(pickle.dumps(_Bomb()))
    opened: list[str] = []
    real_open = io.open

    def spy_open(file, *args, **kwargs):
        opened.append(str(file))
        return real_open(file, *args, **kwargs)

    def forbidden(*args, **kwargs):
        raise AssertionError("unpickling attempted")

    monkeypatch.setattr(io, "open", spy_open)
    monkeypatch.setattr(builtins, "open", spy_open)
    monkeypatch.setattr(torch, "load", forbidden)
    monkeypatch.setattr(pickle, "load", forbidden)
    monkeypatch.setattr(pickle, "loads", forbidden)
    with pytest.raises(AdapterFormatError, match="safetensors") as e:
        load_adapter(folder, mc, max_lora_rank=MAX_RANK)
    assert filename in str(e.value)
    assert not _Bomb.fired
    assert not any(p.endswith(filename) for p in opened)


def test_missing_things(tmp_path, plain, mc):
    with pytest.raises(AdapterNotFoundError, match="does not exist"):
        load_adapter(tmp_path / "nope", mc, max_lora_rank=MAX_RANK)
    (tmp_path / "empty").mkdir()
    with pytest.raises(AdapterNotFoundError, match="holds no adapter"):
        load_adapter(tmp_path / "empty", mc, max_lora_rank=MAX_RANK)
    no_cfg = copy_adapter(plain, tmp_path / "no_cfg")
    (no_cfg / "adapter_config.json").unlink()
    with pytest.raises(AdapterConfigError, match="adapter_config.json"):
        load_adapter(no_cfg, mc, max_lora_rank=MAX_RANK)
    (no_cfg / "adapter_config.json").write_text("{not json")
    with pytest.raises(AdapterConfigError, match="not valid JSON"):
        load_adapter(no_cfg, mc, max_lora_rank=MAX_RANK)


def test_corrupt_safetensors(plain, tmp_path, mc):
    bad = copy_adapter(plain, tmp_path / "corrupt")
    (bad / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage")
    with pytest.raises(AdapterFormatError, match="adapter_model.safetensors"):
        load_adapter(bad, mc, max_lora_rank=MAX_RANK)


def _with(plain: Path, **changes: torch.Tensor | None) -> dict[str, torch.Tensor]:
    tensors = load_file(plain / "adapter_model.safetensors")
    for key, v in changes.items():
        if v is None:
            tensors.pop(key)
        else:
            tensors[key] = v
    return tensors


def test_shape_mismatch_names_key_and_shapes(plain, tmp_path, mc):
    bad = copy_adapter(
        plain, tmp_path / "shape", tensors=_with(plain, **{Q0_A: torch.zeros(8, 63)})
    )
    with pytest.raises(AdapterShapeError) as e:
        load_adapter(bad, mc, max_lora_rank=MAX_RANK)
    msg = str(e.value)
    assert Q0_A in msg and "(8, 63)" in msg and "(8, 64)" in msg and e.value.field == Q0_A


def test_rank_differs_from_config(plain, tmp_path, mc):
    t = _with(plain, **{Q0_A: torch.zeros(4, 64), Q0_B: torch.zeros(64, 4)})
    with pytest.raises(AdapterShapeError, match=r"\(4, 64\).*\(8, 64\)"):
        load_adapter(copy_adapter(plain, tmp_path / "rank4", tensors=t), mc, max_lora_rank=MAX_RANK)


def test_missing_b_and_bad_dtype(plain, tmp_path, mc):
    no_b = copy_adapter(plain, tmp_path / "no_b", tensors=_with(plain, **{Q0_B: None}))
    with pytest.raises(AdapterShapeError, match="no lora_B"):
        load_adapter(no_b, mc, max_lora_rank=MAX_RANK)
    ints = copy_adapter(
        plain,
        tmp_path / "ints",
        tensors=_with(plain, **{Q0_A: torch.zeros(8, 64, dtype=torch.int32)}),
    )
    with pytest.raises(AdapterShapeError, match="I32"):
        load_adapter(ints, mc, max_lora_rank=MAX_RANK)


def test_rank_above_limit(plain, mc):
    with pytest.raises(AdapterRankError, match=r"rank 8 .*max_lora_rank 4"):
        load_adapter(plain, mc, max_lora_rank=4)


@pytest.mark.parametrize(
    ("targets", "named"),
    [
        (["q_proj", "foo_proj"], "foo_proj"),
        (["q_proj", "norm"], "norm"),
        (["embed_tokens", "rotary_emb"], "rotary_emb"),
        (r"model\.layers\.\d+\.foo", "foo"),
        (r"model\.norm", "matches no LoRA module"),
    ],
)
def test_config_targets_module_base_lacks(targets, named, plain, tmp_path, mc):
    bad = copy_adapter(plain, tmp_path / "bad", target_modules=targets)
    with pytest.raises(AdapterTargetError, match=named):
        load_adapter(bad, mc, max_lora_rank=MAX_RANK)


def test_layers_to_transform_out_of_range(plain, tmp_path, mc):
    bad = copy_adapter(plain, tmp_path / "layer5", layers_to_transform=[0, 5])
    with pytest.raises(AdapterTargetError, match="layers_to_transform"):
        load_adapter(bad, mc, max_lora_rank=MAX_RANK)


@pytest.mark.parametrize(
    ("key", "shape", "named"),
    [
        ("base_model.model.lm_head.lora_A.weight", (8, 64), "lm_head"),
        ("base_model.model.lm_head.weight", (256, 64), "lm_head"),
        ("base_model.model.model.embed_tokens.lora_embedding_A", (8, 256), "embed_tokens"),
        ("base_model.model.model.layers.2.self_attn.q_proj.lora_A.weight", (8, 64), "layers.2"),
        ("base_model.model.model.layers.0.mlp.q_proj.lora_A.weight", (8, 64), "mlp.q_proj"),
        ("base_model.model.model.layers.0.mlp.act_fn.lora_A.weight", (8, 64), "act_fn"),
    ],
)
def test_weights_for_modules_base_lacks(key, shape, named, plain, tmp_path, mc):
    t = _with(plain, **{key: torch.zeros(shape)})
    bad = copy_adapter(plain, tmp_path / "bad", tensors=t)
    with pytest.raises(AdapterTargetError, match=named):
        load_adapter(bad, mc, max_lora_rank=MAX_RANK)


def test_weights_for_untargeted_module(plain, tmp_path, mc):
    bad = copy_adapter(plain, tmp_path / "untargeted", target_modules=["k_proj", "v_proj"])
    with pytest.raises(AdapterTargetError, match="does not target"):
        load_adapter(bad, mc, max_lora_rank=MAX_RANK)


def test_non_lora_tensor_in_weights(plain, tmp_path, mc):
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector"
    bad = copy_adapter(plain, tmp_path / "dora_key", tensors=_with(plain, **{key: torch.ones(64)}))
    with pytest.raises(AdapterFormatError, match="lora_magnitude_vector"):
        load_adapter(bad, mc, max_lora_rank=MAX_RANK)


def test_empty_weights(plain, tmp_path, mc):
    empty = write_adapter(
        tmp_path / "no_tensors", json.loads((plain / "adapter_config.json").read_text()), {}
    )
    with pytest.raises(AdapterFormatError, match="no LoRA weights"):
        load_adapter(empty, mc, max_lora_rank=MAX_RANK)
