r"""Parse and check a PEFT ``adapter_config.json`` (plain LoRA, and DoRA: ``use_dora``).

Module names are as PEFT sees them inside a causal LM, e.g. ``model.layers.3.self_attn.q_proj``.
Matching follows PEFT 0.21 exactly (``check_target_module_exists``, ``get_pattern_key``).

Every regex in the file (``target_modules`` / ``exclude_modules`` strings, ``rank_pattern`` /
``alpha_pattern`` keys, ``layers_pattern``) comes from an untrusted file and is run by Python's
backtracking ``re``, one C call holding the GIL: ``(.*){8}z`` takes tens of seconds against one
module name and stops every other thread. So a pattern is admitted only if an upper bound on
its backtracking work against a module name of ``MAX_MODULE_NAME_CHARS`` is at most
``MAX_REGEX_STEPS`` (``regex_bounds.py``); ordinary patterns (``.*\.(q_proj|v_proj)``,
``model\.layers\.\d+\.self_attn\.(q|k|v)_proj``) are far below it and keep PEFT's exact
``re`` semantics.
"""

from __future__ import annotations

import json
import math
import re
import reprlib
from dataclasses import dataclass, field
from typing import Any

from loraplex.engine.adapters.regex_bounds import (
    MAX_MODULE_NAME_CHARS,
    MAX_REGEX_CHARS,
    MAX_REGEX_GROUPS,
    MAX_REGEX_STEPS,
    compiled,
    fullmatch,
    regex_work,
)
from loraplex.engine.errors import AdapterConfigError

__all__ = [
    "ALL_LINEAR",
    "MAX_MODULE_NAME_CHARS",
    "MAX_REGEX_STEPS",
    "PeftLoRAConfig",
    "parse_peft_config",
    "parse_peft_config_json",
    "regex_work",
]

# PEFT shorthand that it expands to every linear layer except the output head.
ALL_LINEAR = "all-linear"


# Keys whose truthy value asks for something other than a plain A/B delta on linear layers.
_REJECT_IF_SET = (
    "use_qalora",
    "lora_bias",
    "fan_in_fan_out",
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
    use_dora: bool = False  # DoRA: every targeted module has a lora_magnitude_vector
    # full tables the adapter replaces (PEFT modules_to_save), as short names: "embed_tokens",
    # "lm_head" (served only with max_full_module_loras > 0, model/lora/full.py)
    modules_to_save: tuple[str, ...] = ()
    # PEFT's ensure_weight_tying: on a base with tied embeddings, a LoRA on embed_tokens also
    # wraps lm_head (and the other way round), saved as a LoRA of its own on the partner
    ensure_weight_tying: bool = False
    # PEFT's target_parameters: parameters wrapped directly (the fused experts' ``gate_up_proj``
    # / ``down_proj``, moe/lora_names.py), matched as PEFT does: equal or a "."-suffix
    target_parameters: tuple[str, ...] = ()

    def targets_parameter(self, name: str) -> bool:
        """Whether PEFT wraps parameter ``name`` (e.g. ``model.layers.0.mlp.experts.down_proj``)."""
        return any(name == t or name.endswith("." + t) for t in self.target_parameters)

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
        """Whether PEFT would wrap ``module_name`` with this config (with
        ``ensure_weight_tying``, the tied partner of a targeted embed_tokens / lm_head too:
        PEFT wraps it on a tied base and saves its LoRA; on an untied one no tensor comes)."""
        if self._targets(module_name):
            return True
        partner = _TIED_PARTNER.get(module_name) if self.ensure_weight_tying else None
        return partner is not None and self._targets(partner)

    def _targets(self, module_name: str) -> bool:
        if self._excluded(module_name):
            return False
        tm = self.target_modules
        if isinstance(tm, str):
            # NOTE: PEFT forbids layers_to_transform with a regex target, so none applies here.
            if tm == ALL_LINEAR:  # every linear layer but the output head
                return not module_name.endswith(("lm_head", "embed_tokens"))
            return fullmatch(tm, _match_name(module_name))
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
            return fullmatch(ex, _match_name(module_name))
        return module_name in ex or any(module_name.endswith("." + e) for e in ex)

    def _layer_index(self, module_name: str) -> int | None:
        if not self.layers_pattern:
            m = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", module_name)
        else:
            m = None
            for pat in self.layers_pattern:
                m = compiled(_layers_regex(pat)).match(_match_name(module_name))
                if m is not None:
                    break
        return int(m.group("idx")) if m else None


_TIED_PARTNER = {"lm_head": "model.embed_tokens", "model.embed_tokens": "lm_head"}


def _key_regex(key: str) -> str:
    return rf"(.*\.)?({key})$"


def _layers_regex(pat: str) -> str:
    return rf"(?:^|.*?\.){pat}\.(?P<idx>\d+)\."


def _pattern_key(patterns: dict[str, Any], module_name: str) -> str | None:
    for key in patterns:  # first match in file order wins
        if fullmatch(_key_regex(key), _match_name(module_name), anchored_end=False):
            return key
    return None


# Values quoted in error messages are cut short: the file is untrusted and up to 1 MiB.
_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 80
_REPR.maxlevel, _REPR.maxlist, _REPR.maxdict = 3, 8, 8


def _show(value: Any) -> str:
    return _REPR.repr(value)


def _fail(name: str, why: str) -> AdapterConfigError:
    return AdapterConfigError(f"adapter_config.json: {name} {why}", field=name)


def _check_regex(name: str, pattern: str) -> None:
    """Admit ``pattern`` only if it compiles and its worst-case work is bounded."""
    if len(pattern) > MAX_REGEX_CHARS or pattern.count("(") > MAX_REGEX_GROUPS:
        raise _fail(
            name,
            f"is a regex of {len(pattern)} characters and {pattern.count('(')} '(' (limits: "
            f"{MAX_REGEX_CHARS} and {MAX_REGEX_GROUPS})",
        )
    try:
        compiled(pattern)
        work = regex_work(pattern, MAX_MODULE_NAME_CHARS)
    except (re.error, RecursionError, OverflowError, ValueError) as e:
        raise _fail(name, f"is not a valid or supported regex ({pattern[:200]!r}: {e})") from None
    if work > MAX_REGEX_STEPS:
        raise _fail(
            name,
            f"regex {pattern[:200]!r} could take ~{work:.2g} backtracking steps per module name "
            f"(limit {MAX_REGEX_STEPS}): nested or repeated unbounded quantifiers such as "
            "'(.*)*' or '.*.*.*' are refused; simplify it or list the modules",
        )


def _match_name(module_name: str) -> str:
    if len(module_name) > MAX_MODULE_NAME_CHARS:  # the bound regex_work was checked for
        raise AdapterConfigError(
            f"module name {module_name!r} is longer than {MAX_MODULE_NAME_CHARS} characters",
            field="target_modules",
        )
    return module_name


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise _fail(name, f"must be a positive integer, got {_show(value)}")
    return value


def _finite_number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _fail(name, f"must be a finite number, got {_show(value)}")
    return float(value)


def _str_list(name: str, value: Any) -> tuple[str, ...]:
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise _fail(name, f"must be a string or a list of strings, got {_show(value)}")
    return tuple(value)


def _patterns(name: str, value: Any, conv: Any) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _fail(name, f"must be an object, got {type(value).__name__}")
    out: dict[str, Any] = {}
    for k, v in value.items():
        if not isinstance(k, str):  # pragma: no cover - JSON object keys are strings
            raise _fail(name, f"has a non-string key {_show(k)}")
        _check_regex(f"{name}[{_show(k)}]", _key_regex(k))
        out[k] = conv(f"{name}[{_show(k)}]", v)
    return out


# modules_to_save entries served as full tables (PEFT matches an entry by suffix of the module
# name: these are the entries that match exactly the embedding or exactly the LM head)
_FULL_MODULES = {"embed_tokens": "embed_tokens", "model.embed_tokens": "embed_tokens",
                 "lm_head": "lm_head"}  # fmt: skip


def _modules_to_save(raw: dict[str, Any]) -> tuple[str, ...]:
    ms = raw.get("modules_to_save")
    if not ms:
        return ()
    names = _str_list("modules_to_save", ms)
    out = []
    for n in names:
        short = _FULL_MODULES.get(n)
        if short is None:
            raise _fail(
                "modules_to_save",
                f"names {_show(n)}: only embed_tokens and lm_head are served as full tables",
            )
        out.append(short)
    for key in ("ensure_weight_tying", "modules_to_tie"):
        if raw.get(key):  # PEFT then shares one table between the tied modules
            raise _fail(key, "with modules_to_save is not supported (tables are served per module)")
    return tuple(sorted(set(out)))


def _targets(raw: dict[str, Any], params: tuple[str, ...]) -> tuple[str, ...] | str:
    """target_modules; missing or empty only next to target_parameters (PEFT saves [] then)."""
    tm = raw.get("target_modules")
    if isinstance(tm, str):
        _check_regex("target_modules", tm)
        return tm
    if tm is None and not params:
        raise _fail("target_modules", "is missing")
    out = _str_list("target_modules", tm if tm is not None else [])
    if not out and not params:
        raise _fail("target_modules", "is empty")
    return tuple(sorted(set(out)))


def _target_parameters(raw: dict[str, Any]) -> tuple[str, ...]:
    tp = raw.get("target_parameters")
    if not tp:
        return ()
    return tuple(sorted(set(_str_list("target_parameters", tp))))


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
        raise _fail(
            "layers_to_transform", f"must be a layer index or a list of them, got {_show(lt)}"
        )
    return tuple(items) or None  # PEFT treats [] as "all layers"


def _layers_pattern(raw: dict[str, Any]) -> tuple[str, ...] | None:
    lp = raw.get("layers_pattern")
    if not lp:
        return None
    pats = (lp,) if isinstance(lp, str) else _str_list("layers_pattern", lp)
    for p in pats:
        _check_regex("layers_pattern", _layers_regex(p))
    return pats


def _excludes(raw: dict[str, Any]) -> tuple[str, ...] | str | None:
    ex = raw.get("exclude_modules")
    if not ex:
        return None
    if isinstance(ex, str):
        _check_regex("exclude_modules", ex)
        return ex
    return _str_list("exclude_modules", ex)


def parse_peft_config_json(data: bytes) -> PeftLoRAConfig:
    """Parse the bytes of an adapter_config.json; every failure is an AdapterConfigError (the
    one parser of admin loads, dynamic loads and ``--lora-modules`` at start-up)."""
    try:
        raw: Any = json.loads(data.decode("utf-8"))
    except RecursionError:  # e.g. 100k nested '[': the decoder recurses per level
        raise AdapterConfigError(
            "adapter_config.json is nested too deeply", field="adapter_config.json"
        ) from None
    except (UnicodeDecodeError, ValueError) as e:  # JSONDecodeError; ints over 4300 digits
        raise AdapterConfigError(
            f"adapter_config.json is not valid JSON: {str(e)[:200]}", field="adapter_config.json"
        ) from None
    return parse_peft_config(raw)


def parse_peft_config(raw: dict[str, Any]) -> PeftLoRAConfig:
    """Check an adapter_config.json dict; raise AdapterConfigError naming the offending field."""
    if not isinstance(raw, dict):
        raise AdapterConfigError("adapter_config.json must hold a JSON object")
    if raw.get("peft_type") != "LORA":
        raise _fail("peft_type", f"must be 'LORA', got {_show(raw.get('peft_type'))}")
    for key in _REJECT_IF_SET:
        if raw.get(key):
            raise _fail(key, f"is not supported (got {_show(raw[key])})")
    bias = raw.get("bias", "none")
    if bias not in ("none", None):
        raise _fail("bias", f"must be 'none', got {_show(bias)}")
    use_rslora = raw.get("use_rslora", False)
    if not isinstance(use_rslora, bool):
        raise _fail("use_rslora", f"must be true or false, got {_show(use_rslora)}")
    use_dora = raw.get("use_dora", False)
    if use_dora is not None and not isinstance(use_dora, bool):
        raise _fail("use_dora", f"must be true or false, got {_show(use_dora)}")
    params = _target_parameters(raw)
    targets = _targets(raw, params)
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
        use_dora=bool(use_dora),
        modules_to_save=_modules_to_save(raw),
        ensure_weight_tying=_flag(raw, "ensure_weight_tying"),
        target_parameters=params,
    )


def _flag(raw: dict[str, Any], name: str) -> bool:
    value = raw.get(name, False)
    if value is not None and not isinstance(value, bool):
        raise _fail(name, f"must be true or false, got {_show(value)}")
    return bool(value)
