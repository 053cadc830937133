"""Load a PEFT LoRA adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``).

Only safetensors are read: pickle-based weight files are refused, never opened.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from loraplex.engine.adapters.checks import (
    MAX_ADAPTER_WEIGHT,
    check_added_rows,
    check_dora_pair,
    check_expert_forms,
    check_folded_values,
    check_full_modules_allowed,
    check_full_table,
    check_full_tables_present,
    check_module_exists,
    check_table_copy,
    check_weight_values,
    fold_scale_into,
    is_table_copy,
    is_targeted,
    module_dims,
    parse_key,
    resolve_expert_module,
)
from loraplex.engine.adapters.files import (
    CONFIG_FILE,
    DEFAULT_MAX_HEADER_BYTES,
    TORCH_DTYPES,
    WEIGHTS_FILE,
    FileTensors,
    read_safetensors_header,
)
from loraplex.engine.adapters.peft_config import PeftLoRAConfig, parse_peft_config_json
from loraplex.engine.adapters.targets import base_module_name, check_targets
from loraplex.engine.errors import (
    AdapterConfigError,
    AdapterFormatError,
    AdapterNotFoundError,
    AdapterRankError,
    AdapterShapeError,
    AdapterTargetError,
)
from loraplex.engine.model.config import (
    MODULE_ORDER,
    ModelConfig,
)
from loraplex.engine.model.lora.slot_image import PackedAdapter
from loraplex.engine.model.lora.weights import LoRAWeights, WeightsView

__all__ = [
    "MAX_ADAPTER_WEIGHT",
    "check_adapter_values",
    "LoRAWeights",
    "LoRAAdapter",
    "load_adapter",
    "base_module_name",
    "check_targets",
    "check_weight_values",
    "load_magnitudes",
    "load_full_tables",
    "CONFIG_FILE",
]

_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
_DTYPES = TORCH_DTYPES

# (layer, module) -> (r, in, out) of every targeted module, and what receives each module's
# checked tensors: (layer, module), A (r, in), B (out, r) unscaled, the LoRA scale. The tensors
# are views of the file's read buffer: copy what is kept.
ModuleDims = dict[tuple[int, str], tuple[int, int, int, int]]  # (r, in, out, experts)
PairSink = Callable[[tuple[int, str], torch.Tensor, torch.Tensor, float], None]


@dataclass
class LoRAAdapter:
    name: str
    path: str
    config: PeftLoRAConfig
    # (layer index, module short name) -> tensors; a WeightsView once packed (slot_image.py)
    weights: dict[tuple[int, str], LoRAWeights] | WeightsView
    # DoRA: (layer, module) -> the row scale m / ||W + s B A|| (out,) float32, folded into B
    # too (dora.py); None for plain LoRA and until computed against the base
    dora: dict[tuple[int, str], torch.Tensor] | None = None
    # modules_to_save: "embed_tokens" / "lm_head" -> the full (vocab, hidden) table that
    # replaces the base's for this adapter's rows (model/lora/full.py); empty for most adapters
    full: dict[str, torch.Tensor] = field(default_factory=dict)
    # its slot image (model/lora/slot_image.py; ``weights`` are views of it), once staged; and
    # under tensor parallelism every rank's packed shard (ParallelRunner.prepare_adapter)
    image: PackedAdapter | None = None
    shard_images: tuple[PackedAdapter, ...] | None = None

    @property
    def rank(self) -> int:
        """Largest rank over all modules."""
        if isinstance(self.weights, WeightsView):
            return self.weights.rank
        return max((w.a.shape[0] // w.experts for w in self.weights.values()), default=0)

    @property
    def nbytes(self) -> int:
        full = sum(t.nbytes for t in self.full.values())
        if isinstance(self.weights, WeightsView):
            return self.weights.nbytes + full
        return sum(w.a.nbytes + w.b.nbytes for w in self.weights.values()) + full


def _read_config(folder: Path) -> PeftLoRAConfig:
    p = folder / CONFIG_FILE
    if not p.is_file():
        raise AdapterConfigError(f"no {CONFIG_FILE} in {folder}", field=CONFIG_FILE)
    return parse_peft_config_json(p.read_bytes())


def _weights_file(folder: Path) -> Path:
    p = folder / WEIGHTS_FILE
    if p.is_file():
        return p
    pickles = sorted(f.name for f in folder.iterdir() if f.name.endswith(_PICKLE_SUFFIXES))
    if pickles:
        raise AdapterFormatError(
            f"{folder} has {', '.join(pickles)} but no {WEIGHTS_FILE}: safetensors is required "
            "(pickle-based weight files are never loaded)",
            field=WEIGHTS_FILE,
        )
    if not (folder / CONFIG_FILE).exists():
        raise AdapterNotFoundError(
            f"{folder} holds no adapter (no {CONFIG_FILE}, no {WEIGHTS_FILE})"
        )
    raise AdapterFormatError(f"no {WEIGHTS_FILE} in {folder}", field=WEIGHTS_FILE)


def _index(
    f: safe_open, config: PeftLoRAConfig, mc: ModelConfig, tables: dict[str, str] | None = None
) -> dict[tuple[int, str], dict[str, str]]:
    """Map (layer, module) -> {"A": key, "B": key} from the header; no tensor data is read.
    ``tables`` gets the modules_to_save tables' keys by module (checked: listed, base shape)."""
    found: dict[tuple[int, str], dict[str, str]] = {}
    seen: dict[str, str] = {}
    rows: dict[str, int] = {}
    for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
        if is_table_copy(key, mc):
            check_table_copy(key, list(f.get_slice(key).get_shape()), mc)
            continue
        layer, module, ab = parse_key(key, mc.num_layers)
        module = resolve_expert_module(layer, module, key, config, mc)
        full = base_module_name(layer, module)
        if ab == "BASE":
            _check_base_table(key, list(f.get_slice(key).get_shape()), module, mc)
            continue
        if ab == "FULL":
            sl = f.get_slice(key)
            check_full_table(key, module, list(sl.get_shape()), sl.get_dtype(), config, mc)
            seen[module] = key
            rows[module] = sl.get_shape()[0]
            continue
        if not is_targeted(config, full, module):
            raise AdapterTargetError(
                f"{WEIGHTS_FILE}: tensor {key!r} is for {full!r}, which {CONFIG_FILE} does not target",
                field=key,
            )
        check_module_exists(layer, module, key, mc)
        pair = found.setdefault((layer, module), {})
        if ab in pair:
            raise AdapterFormatError(
                f"{WEIGHTS_FILE}: two lora_{ab} tensors for {full!r}", field=key
            )
        pair[ab] = key
    check_expert_forms({k: next(iter(p.values())) for k, p in found.items()}, config)
    for (layer, module), pair in found.items():
        check_dora_pair(pair, config, base_module_name(layer, module), lambda k: k)
        if "A" not in pair or "B" not in pair:
            missing = "lora_B" if "A" in pair else "lora_A"
            key = next(iter(pair.values()))
            raise AdapterShapeError(
                f"{WEIGHTS_FILE}: {base_module_name(layer, module)!r} has {key!r} but no {missing}",
                field=key,
            )
    if not found:
        raise AdapterFormatError(f"{WEIGHTS_FILE} holds no LoRA weights", field=WEIGHTS_FILE)
    check_full_tables_present(seen, config)
    check_added_rows(rows, mc)
    if tables is not None:
        tables.update(seen)
    return found


def _check_base_table(key: str, shape: list[int], module: str, mc: ModelConfig) -> None:
    """PEFT's copy of the base table next to an embedding / LM head LoRA must be the base's
    shape (a resized vocabulary is not this base's)."""
    want = [mc.vocab_size, mc.hidden_size]
    if shape != want:
        raise AdapterShapeError(
            f"{WEIGHTS_FILE}: tensor {key!r} has shape {tuple(shape)}; the base's {module} is "
            f"{tuple(want)} (an adapter for a resized vocabulary does not fit this base)",
            field=key,
        )


def _check_pair(
    f: safe_open, pair: dict[str, str], r: int, dims: tuple[int, int, int], max_rank: int
) -> None:
    """Check dtype, shapes (A: (r, in), B: (out, r); a fused experts module's: r * E for r)
    and rank against the limit."""
    d_in, d_out, experts = dims
    rows = list(f.get_slice(pair["A"]).get_shape())[:1]
    if experts > 1 and rows != [r * experts]:
        raise AdapterShapeError(
            f"{WEIGHTS_FILE}: tensor {pair['A']!r} has {rows} rows; it wants rank {r} x "
            f"{experts} experts = {r * experts} (an adapter for another expert count does not "
            "fit this base)",
            field=pair["A"],
        )
    for ab, want in (("A", [r * experts, d_in]), ("B", [d_out, r * experts])):
        key = pair[ab]
        sl = f.get_slice(key)
        if sl.get_dtype() not in _DTYPES:
            raise AdapterShapeError(
                f"{WEIGHTS_FILE}: tensor {key!r} has dtype {sl.get_dtype()}; "
                f"only {', '.join(_DTYPES)} are supported",
                field=key,
            )
        got = list(sl.get_shape())
        if got != want:
            raise AdapterShapeError(
                f"{WEIGHTS_FILE}: tensor {key!r} has shape {tuple(got)}, expected {tuple(want)}",
                field=key,
            )
    if "M" in pair:
        sl = f.get_slice(pair["M"])
        if sl.get_dtype() not in _DTYPES or list(sl.get_shape()) != [d_out]:
            raise AdapterShapeError(
                f"{WEIGHTS_FILE}: DoRA magnitude {pair['M']!r} has {sl.get_dtype()} "
                f"{tuple(sl.get_shape())}, expected ({d_out},) of {', '.join(_DTYPES)}",
                field=pair["M"],
            )
    if r > max_rank:
        raise AdapterRankError(
            f"adapter rank {r} (tensor {pair['A']!r}) is above max_lora_rank {max_rank}",
            field=pair["A"],
        )


def load_adapter(
    path: str | Path,
    model_config: ModelConfig,
    *,
    max_lora_rank: int,
    name: str | None = None,
    dtype: torch.dtype = torch.float32,
    full_modules: bool = False,
    read_full: bool = True,
    keep: bool = True,
    sink_for: Callable[[ModuleDims], PairSink] | None = None,
) -> LoRAAdapter:
    """Read, check and load an adapter folder; tensors come back on CPU in ``dtype``.

    ``full_modules``: the engine serves modules_to_save tables (else such an adapter is an
    AdapterConfigError); ``read_full``: read them into ``adapter.full`` (else only their
    headers are checked, see ``load_full_tables``); ``keep=False``: every check, values
    included, and no weights kept (``check_adapter_values``); ``sink_for``: called once every
    header is checked with the modules' dims, returns what receives each module's checked
    tensors in place of ``adapter.weights`` (``staging.stage_file`` packs them straight into a
    slot image). Tensor data is read from a private mapping of the file, each byte once."""
    folder = Path(path)
    if not folder.is_dir():
        raise AdapterNotFoundError(f"adapter folder {str(path)!r} does not exist")
    wfile = _weights_file(folder)
    config = _read_config(folder)
    check_targets(config, model_config)
    check_full_modules_allowed(config, full_modules)
    # NOTE: the strict header check of preflight (duplicate keys, gaps, overlaps), so that this
    # parser accepts no file the preflight would refuse (safetensors keeps the last of two
    # duplicate keys)

    header = read_safetensors_header(wfile, max_header_bytes=DEFAULT_MAX_HEADER_BYTES)
    weights: dict[tuple[int, str], LoRAWeights] = {}
    tables: dict[str, str] = {}
    full_tables: dict[str, torch.Tensor] = {}
    try:
        with safe_open(str(wfile), framework="pt") as f:
            found = _index(f, config, model_config, tables)
            order = sorted(found, key=lambda lm: (lm[0], MODULE_ORDER[lm[1]]))
            dims: ModuleDims = {}
            for key in order:  # check every header first, then read data
                r = config.rank_for(base_module_name(*key))
                mdims = module_dims(*key, model_config)
                _check_pair(f, found[key], r, mdims, max_lora_rank)
                dims[key] = (r, *mdims)
            sink = sink_for(dims) if sink_for is not None else None
            data = FileTensors(wfile, header, [k for p in found.values() for k in (p["A"], p["B"])])
            for layer, module in order:
                full, pair = base_module_name(layer, module), found[(layer, module)]
                scale = config.scale_for(full)
                a, b = data[pair["A"]], data[pair["B"]]
                # NOTE: the values as folded in f32, before the cast to ``dtype``, so that
                # no NaN/Inf/huge value reaches a slot
                check_weight_values(a, pair["A"])
                check_folded_values(b, pair["B"], scale)
                if sink is not None:
                    sink((layer, module), a, b, scale)
                elif keep:  # own copies: nothing may point into the read buffer
                    fb = torch.empty(b.shape, dtype=dtype)
                    fold_scale_into(fb, b, scale)
                    weights[(layer, module)] = LoRAWeights(
                        a=a.to(dtype, copy=True), b=fb, experts=dims[(layer, module)][3]
                    )
            if read_full:
                full_tables = _read_tables(f, tables, dtype)
    except (SafetensorError, OSError, ValueError) as e:
        raise AdapterFormatError(f"{wfile} cannot be read: {e}", field=WEIGHTS_FILE) from None
    return LoRAAdapter(
        name=name or folder.name, path=str(folder), config=config, weights=weights, full=full_tables
    )


def _read_tables(
    f: safe_open, tables: dict[str, str], dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    out = {}
    for module, key in sorted(tables.items()):
        t = f.get_tensor(key)
        check_weight_values(t, key)
        out[module] = t.to(dtype).contiguous()
    return out


def load_full_tables(
    path: str | Path, model_config: ModelConfig, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """The modules_to_save tables of an adapter folder that passed ``load_adapter`` (headers
    checked again), in ``dtype``; empty if it has none."""
    folder = Path(path)
    config = _read_config(folder)
    if not config.modules_to_save:
        return {}
    tables: dict[str, str] = {}
    try:
        with safe_open(str(folder / WEIGHTS_FILE), framework="pt") as f:
            _index(f, config, model_config, tables)
            return _read_tables(f, tables, dtype)
    except (SafetensorError, OSError) as e:
        raise AdapterFormatError(f"{folder} cannot be read: {e}", field=WEIGHTS_FILE) from None


def load_magnitudes(
    path: str | Path, model_config: ModelConfig
) -> dict[tuple[int, str], torch.Tensor]:
    """A DoRA adapter's magnitude vectors (out,) in float32, checked finite and in range
    (``check_weight_values``); empty for a plain adapter. The folder passed ``load_adapter``."""
    folder = Path(path)
    config = _read_config(folder)
    if not config.use_dora:
        return {}
    out = {}
    with safe_open(str(folder / WEIGHTS_FILE), framework="pt") as f:
        for key, pair in _index(f, config, model_config).items():
            m = f.get_tensor(pair["M"]).float()
            check_weight_values(m, pair["M"])
            out[key] = m
    return out


def check_adapter_values(
    path: str | Path, model_config: ModelConfig, *, max_lora_rank: int, full_modules: bool = False
) -> None:
    """Parse every tensor once and check its values (``check_weight_values``), keeping
    nothing: a registration refuses garbage weights before any request can ask for them."""
    load_adapter(
        path, model_config, max_lora_rank=max_lora_rank, dtype=torch.float32,
        full_modules=full_modules, keep=False,
    )  # fmt: skip
    load_magnitudes(path, model_config)
