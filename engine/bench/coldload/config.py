"""Study configuration: one point (one engine), and the grid that ``--sweep`` makes of it."""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Any

__all__ = [
    "EVICTIONS",
    "Lengths",
    "PointConfig",
    "SOURCES",
    "SYNTHETIC",
    "parse_sweep",
    "grid",
    "label_of",
]

SOURCES = ("local", "s3", "hub")
SYNTHETIC = ("tiny", "llama3-8b")
# EngineConfig.adapter_eviction's names (this module stays import-light: the ``loraplex``
# parser imports it for every command; a test keeps the two equal)
EVICTIONS = ("lru", "lfu", "gdsf", "gdf")


@dataclass(frozen=True)
class Lengths:
    """A token count: fixed (``lo == hi``) or uniform over ``[lo, hi]``."""

    lo: int
    hi: int

    @staticmethod
    def parse(text: str) -> Lengths:
        """``"128"`` or ``"64-512"``."""
        lo, _, hi = str(text).partition("-")
        out = Lengths(int(lo), int(hi or lo))
        if out.lo < 1 or out.hi < out.lo:
            raise ValueError(f"bad length range {text!r}: want N or LO-HI with 1 <= LO <= HI")
        return out

    def __str__(self) -> str:
        return str(self.lo) if self.lo == self.hi else f"{self.lo}-{self.hi}"


@dataclass(frozen=True)
class PointConfig:
    """Everything one engine run of the study depends on."""

    # model: a checkpoint folder, else a random model of a synthetic shape
    model: str | None = None
    synthetic: str = "tiny"
    device: str = "auto"
    dtype: str = "auto"
    # adapters and where they are served from
    num_adapters: int = 100
    rank: int = 16
    targets: tuple[str, ...] = ("q_proj", "v_proj")
    distinct: int = 0  # distinct weight files (others hardlink them); 0: one per adapter
    source: str = "local"
    # open-loop workload
    rate: float = 4.0  # requests / s (Poisson)
    duration: float = 30.0  # seconds of arrivals (then drain)
    alpha: float = 1.0  # Zipf exponent of adapter popularity
    base_fraction: float = 0.0  # share of requests on the base model
    prompt_len: Lengths = Lengths(128, 512)
    output_len: Lengths = Lengths(32, 128)
    seed: int = 0
    # engine
    max_loras: int = 8
    max_cpu_loras: int = 32
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    kv_cache_gb: float = 0.0  # 0: the engine's default sizing
    cuda_graphs: bool = True
    max_concurrent_loads: int = 0  # 0: the engine's default
    loader_processes: int = -1  # -1: the engine's default (helpers on CUDA, none on CPU)
    # both adapter tiers' eviction policy (EngineConfig.adapter_eviction): sweep
    # ``adapter_eviction=lru,gdf`` for the A/B on one trace (the arrivals depend on the seed)
    adapter_eviction: str = "lru"
    # run
    warmup: bool = True
    drain_timeout: float = 60.0
    # also serve the same trace with every adapter it uses pre-staged in the CPU tier (no cold
    # loads): the yardstick the cold run's ITL is compared with
    warm_yardstick: bool = False

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ValueError(f"source must be one of {SOURCES}, not {self.source!r}")
        if self.model is None and self.synthetic not in SYNTHETIC:
            raise ValueError(f"synthetic must be one of {SYNTHETIC}, not {self.synthetic!r}")
        if self.num_adapters < 1 or self.rank < 1 or self.rate <= 0 or self.duration <= 0:
            raise ValueError("num_adapters, rank, rate and duration must be positive")
        if not 0.0 <= self.base_fraction <= 1.0:
            raise ValueError("base_fraction must lie in [0, 1]")
        if self.adapter_eviction not in EVICTIONS:
            raise ValueError(
                f"adapter_eviction must be one of {', '.join(EVICTIONS)}, "
                f"not {self.adapter_eviction!r}"
            )
        if self.max_cpu_loras < self.max_loras:  # the engine backs every slot by the CPU tier
            object.__setattr__(self, "max_cpu_loras", self.max_loras)

    def adapter_key(self) -> tuple[Any, ...]:
        """What the adapter files depend on (points sharing it share the files)."""
        return (
            self.model or self.synthetic,
            self.num_adapters,
            self.rank,
            self.targets,
            self.distinct or self.num_adapters,
            self.seed,
        )

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out.update(
            targets=list(self.targets),
            prompt_len=str(self.prompt_len),
            output_len=str(self.output_len),
        )
        return out


def _convert(name: str, text: str) -> Any:
    """A sweep value of field ``name`` from its text (``targets`` joins modules with ``+``)."""
    fields = {f.name: f for f in dataclasses.fields(PointConfig)}
    if name not in fields:
        raise ValueError(f"unknown sweep key {name!r}; keys: {', '.join(sorted(fields))}")
    default = fields[name].default
    if name == "targets":
        return tuple(t for t in text.split("+") if t)
    if name == "adapter_eviction" and text not in EVICTIONS:  # (refused before any run)
        raise ValueError(f"adapter_eviction: {text!r} is not one of {', '.join(EVICTIONS)}")
    if isinstance(default, Lengths):
        return Lengths.parse(text)
    if isinstance(default, bool):
        if text.lower() not in ("1", "0", "true", "false", "yes", "no"):
            raise ValueError(f"{name}: {text!r} is not a boolean")
        return text.lower() in ("1", "true", "yes")
    if isinstance(default, int):
        return int(text)
    if isinstance(default, float):
        return float(text)
    return text


def parse_sweep(specs: list[str]) -> dict[str, list[Any]]:
    """``["max_loras=8,32", "alpha=0.8,1.1"]`` -> ``{"max_loras": [8, 32], "alpha": [0.8, 1.1]}``."""
    out: dict[str, list[Any]] = {}
    for spec in specs:
        key, sep, values = spec.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not values:
            raise ValueError(f"sweep spec {spec!r} is not KEY=V1,V2,...")
        if key in out:
            raise ValueError(f"sweep key {key!r} given twice")
        out[key] = [_convert(key, v.strip()) for v in values.split(",") if v.strip()]
    return out


def grid(
    base: PointConfig, sweep: dict[str, list[Any]]
) -> list[tuple[dict[str, Any], PointConfig]]:
    """Every combination of the sweep values applied to ``base`` (sweep order, first key slowest)."""
    keys = list(sweep)
    points = []
    for combo in itertools.product(*(sweep[k] for k in keys)):
        values = dict(zip(keys, combo, strict=True))
        points.append((values, dataclasses.replace(base, **values)))
    return points


def label_of(values: dict[str, Any]) -> str:
    """A folder-safe name of one grid point, e.g. ``max_loras-8_alpha-0.8``."""
    if not values:
        return "run"
    parts = []
    for k, v in values.items():
        text = "+".join(v) if isinstance(v, tuple) else str(v)
        parts.append(f"{k}-{text}")
    return "_".join(parts).replace("/", "-")
