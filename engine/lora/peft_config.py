"""Parse and check a PEFT ``adapter_config.json`` (plain LoRA only).

Module names are as PEFT sees them inside a causal LM, e.g. ``model.layers.3.self_attn.q_proj``.
Matching follows PEFT 0.21 exactly (``check_target_module_exists``, ``get_pattern_key``).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from loraplex.engine.lora.errors import AdapterConfigError

__all__ = ["PeftLoRAConfig", "parse_peft_config", "ALL_LINEAR"]

# PEFT shorthand that it expands to every linear layer except the output head.
ALL_LINEAR = "all-linear"

# Keys whose truthy value asks for something other than a plain A/B delta on linear layers.
_REJECT_IF_SET = (
    "use_dora",
    "use_qalora",
    "lora_bias",
    "fan_in_fan_out",
    "modules_to_save",
    "target_parameters",
    "trainable_token_indices",
    "layer_replication",
    "alora_invocation_tokens",
    "use_bdlora",
    "arrow_config",
    "kasa_config",
    "monteclora_config",
)


@dataclass(frozen=True)
class PeftLoRAConfig:
    r: int
    lora_alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...] | str  # list form, or one regex string (re.fullmatch)
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)
    layers_to_transform: tuple[int, ...] | None = None
    layers_pattern: tuple[str, ...] | None = None
    base_model_name_or_path: str | None = None
    exclude_modules: tuple[str, ...] | str | None = None

    def rank_for(self, module_name: str) -> int:
        """Rank of ``module_name``: the first matching ``rank_pattern`` key, else ``r``."""
        key = _pattern_key(self.rank_pattern, module_name)
        return self.r if key is None else self.rank_pattern[key]

    def alpha_for(self, module_name: str) -> float:
        """Alpha of ``module_name``: the first matching ``alpha_pattern`` key, else ``lora_alpha``."""
        key = _pattern_key(self.alpha_pattern, module_name)
        return self.lora_alpha if key is None else self.alpha_pattern[key]

    def scale_for(self, module_name: str) -> float:
        """LoRA scale: ``alpha / r``, or ``alpha / sqrt(r)`` with rsLoRA."""
        r, alpha = self.rank_for(module_name), self.alpha_for(module_name)
        return alpha / math.sqrt(r) if self.use_rslora else alpha / r

    def targets(self, module_name: str) -> bool:
        """Whether PEFT would wrap ``module_name`` with this config."""
        if self._excluded(module_name):
            return False
        tm = self.target_modules
        if isinstance(tm, str):
            # NOTE: PEFT forbids layers_to_transform with a regex target, so none applies here.
            if tm == ALL_LINEAR:  # every linear layer but the output head
                return not module_name.endswith(("lm_head", "embed_tokens"))
            return re.fullmatch(tm, module_name) is not None
        if module_name in tm:
            return True  # an exact name bypasses layers_to_transform, as in PEFT
        if not any(module_name.endswith("." + t) for t in tm):
            return False
        if not self.layers_to_transform:
            return True
        idx = self._layer_index(module_name)
        return idx is not None and idx in self.layers_to_transform

    def _excluded(self, module_name: str) -> bool:
        ex = self.exclude_modules
        if not ex:
            return False
        if isinstance(ex, str):
            return re.fullmatch(ex, module_name) is not None
        return module_name in ex or any(module_name.endswith("." + e) for e in ex)

    def _layer_index(self, module_name: str) -> int | None:
        if not self.layers_pattern:
            m = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", module_name)
        else:
            m = None
            for pat in self.layers_pattern:
                m = re.match(rf"(?:^|.*?\.){pat}\.(?P<idx>\d+)\.", module_name)
                if m is not None:
                    break
        return int(m.group("idx")) if m else None


def _pattern_key(patterns: dict[str, Any], module_name: str) -> str | None:
    for key in patterns:  # first match in file order wins
        if re.match(rf"(.*\.)?({key})$", module_name):
            return key
    return None


def _fail(name: str, why: str) -> AdapterConfigError:
    return AdapterConfigError(f"adapter_config.json: {name} {why}", field=name)


def _check_regex(name: str, pattern: str) -> None:
    try:
        re.compile(pattern)
    except re.error as e:
        raise _fail(name, f"is not a valid regex ({pattern!r}: {e})") from None


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise _fail(name, f"must be a positive integer, got {value!r}")
    return value


def _finite_number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _fail(name, f"must be a finite number, got {value!r}")
    return float(value)


def _str_list(name: str, value: Any) -> tuple[str, ...]:
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise _fail(name, f"must be a string or a list of strings, got {value!r}")
    return tuple(value)


def _patterns(name: str, value: Any, conv: Any) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _fail(name, f"must be an object, got {type(value).__name__}")
    out: dict[str, Any] = {}
    for k, v in value.items():
        _check_regex(f"{name}[{k!r}]", rf"(.*\.)?({k})$")
        out[k] = conv(f"{name}[{k!r}]", v)
    return out


def _targets(raw: dict[str, Any]) -> tuple[str, ...] | str:
    tm = raw.get("target_modules")
    if isinstance(tm, str):
        _check_regex("target_modules", tm)
        return tm
    if tm is None:
        raise _fail("target_modules", "is missing")
    out = _str_list("target_modules", tm)
    if not out:
        raise _fail("target_modules", "is empty")
    return tuple(sorted(set(out)))


def _layers(raw: dict[str, Any], targets: tuple[str, ...] | str) -> tuple[int, ...] | None:
    lt = raw.get("layers_to_transform")
    if lt is None:
        return None
    if isinstance(targets, str):
        raise _fail("layers_to_transform", "cannot be used when target_modules is a regex string")
    items = [lt] if isinstance(lt, int) and not isinstance(lt, bool) else lt
    if not isinstance(items, list) or any(
        isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in items
    ):
        raise _fail("layers_to_transform", f"must be a layer index or a list of them, got {lt!r}")
    return tuple(items) or None  # PEFT treats [] as "all layers"


def _layers_pattern(raw: dict[str, Any]) -> tuple[str, ...] | None:
    lp = raw.get("layers_pattern")
    if not lp:
        return None
    pats = (lp,) if isinstance(lp, str) else _str_list("layers_pattern", lp)
    for p in pats:
        _check_regex("layers_pattern", p)
    return pats


def _excludes(raw: dict[str, Any]) -> tuple[str, ...] | str | None:
    ex = raw.get("exclude_modules")
    if not ex:
        return None
    if isinstance(ex, str):
        _check_regex("exclude_modules", ex)
        return ex
    return _str_list("exclude_modules", ex)


def parse_peft_config(raw: dict[str, Any]) -> PeftLoRAConfig:
    """Check an adapter_config.json dict; raise AdapterConfigError naming the offending field."""
    if not isinstance(raw, dict):
        raise AdapterConfigError("adapter_config.json must hold a JSON object")
    if raw.get("peft_type") != "LORA":
        raise _fail("peft_type", f"must be 'LORA', got {raw.get('peft_type')!r}")
    for key in _REJECT_IF_SET:
        if raw.get(key):
            raise _fail(key, f"is not supported (got {raw[key]!r})")
    bias = raw.get("bias", "none")
    if bias not in ("none", None):
        raise _fail("bias", f"must be 'none', got {bias!r}")
    use_rslora = raw.get("use_rslora", False)
    if not isinstance(use_rslora, bool):
        raise _fail("use_rslora", f"must be true or false, got {use_rslora!r}")
    targets = _targets(raw)
    layers_pattern = _layers_pattern(raw)
    layers = _layers(raw, targets)
    if layers_pattern and isinstance(targets, str):
        raise _fail("layers_pattern", "cannot be used when target_modules is a regex string")
    base = raw.get("base_model_name_or_path")
    return PeftLoRAConfig(
        r=_positive_int("r", raw.get("r")),
        lora_alpha=_finite_number("lora_alpha", raw.get("lora_alpha")),
        use_rslora=use_rslora,
        target_modules=targets,
        rank_pattern=_patterns("rank_pattern", raw.get("rank_pattern"), _positive_int),
        alpha_pattern=_patterns("alpha_pattern", raw.get("alpha_pattern"), _finite_number),
        layers_to_transform=layers,
        layers_pattern=layers_pattern,
        base_model_name_or_path=base if isinstance(base, str) else None,
        exclude_modules=_excludes(raw),
    )
