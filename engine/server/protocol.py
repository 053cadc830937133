"""Parse and validate OpenAI request bodies (completions, chat) into a ``GenerationRequest``.

Field names follow the OpenAI API plus vLLM's extra sampling fields (``top_k``, ``min_tokens``,
``ignore_eos``, ``stop_token_ids``, ``return_token_ids``, ``return_tokens_as_token_ids``).
Unknown fields are ignored, as vLLM does; features we do not implement are refused (400).
The work a request may cause is bounded here, before anything is tokenized (``ServerLimits``);
every string that reaches the tokenizer or a reply must be valid UTF-8 (no lone surrogates).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from loraplex.engine.sampling_params import MAX_LOGPROBS, SamplingParams
from loraplex.engine.server.body import check_depth, parse_json
from loraplex.engine.server.errors import APIError
from loraplex.engine.server.fields import tree_chars, utf8
from loraplex.engine.server.guided import parse_structured
from loraplex.engine.server.limits import ServerLimits, flag
from loraplex.engine.server.tool_checks import check_tool_turns
from loraplex.engine.server.tools import Tools, parse_tools
from loraplex.engine.structured import StructuredOutput

__all__ = ["GenerationRequest", "parse_json", "parse_completion", "parse_chat", "MAX_N"]

MAX_N = 128
_SEED_MAX = 2**64 - 1
_SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "min_tokens",
    "speculative",  # false: this request opts out of speculative decoding (the engine's)
)


def bad(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


@dataclass
class GenerationRequest:
    """A validated request: what to run and how to shape the reply."""

    model: str | None
    prompts: list[str | list[int]] = field(default_factory=list)  # completions
    messages: list[dict[str, Any]] | None = None  # chat
    chat_kwargs: dict[str, Any] = field(default_factory=dict)
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    max_tokens: int | None = None
    logprobs: int | None = None  # top logprobs per token the engine returns (None: off)
    return_token_ids: bool = False
    tokens_as_ids: bool = False
    sampling: dict[str, Any] = field(default_factory=dict)
    adapters: list[tuple[str, float]] | None = None  # a composition ("adapters" field)
    structured: StructuredOutput | None = None  # response_format, structured_outputs, guided_*
    tools: Tools | None = None  # chat: tools that may be called (tool_choice not "none")

    def params(self, prompt_len: int, limit: int, choice: int = 0) -> SamplingParams:
        """Engine params for one choice; ``limit`` is the longest prompt + output allowed."""
        max_tokens = self.max_tokens
        if max_tokens is None:
            max_tokens = limit - prompt_len
            if max_tokens < 1:
                raise bad(
                    f"the prompt ({prompt_len} tokens) leaves no room to generate within the "
                    f"maximum context length {limit}",
                    "prompt" if self.messages is None else "messages",
                )
        kw = dict(self.sampling)
        seed = kw.get("seed")
        if choice and isinstance(seed, int) and not isinstance(seed, bool):
            # NOTE: choice i samples with seed + i so n seeded choices differ, reproducibly.
            kw["seed"] = seed + choice if seed + choice <= _SEED_MAX else seed - choice
        return SamplingParams(
            max_tokens=max_tokens, logprobs=self.logprobs, structured=self.structured, **kw
        )


def _check_chars(chars: int, limits: ServerLimits, param: str) -> None:
    if limits.max_prompt_chars is not None and chars > limits.max_prompt_chars:
        raise bad(
            f"the prompt text is {chars} characters, more than {limits.max_prompt_chars} "
            f"({flag('max_prompt_chars')})",
            param,
        )


def _check_stops(body: dict[str, Any], limits: ServerLimits) -> None:
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop
    if isinstance(stops, list):
        if len(stops) > limits.max_stop_strings:
            raise bad(
                f"stop holds {len(stops)} strings, more than {limits.max_stop_strings} "
                f"({flag('max_stop_strings')})",
                "stop",
            )
        for s in stops:
            if isinstance(s, str) and len(utf8(s, "stop")) > limits.max_stop_string_chars:
                raise bad(
                    f"a stop string is {len(s)} characters, more than "
                    f"{limits.max_stop_string_chars} ({flag('max_stop_string_chars')})",
                    "stop",
                )
    ids = body.get("stop_token_ids")
    if isinstance(ids, list) and len(ids) > limits.max_stop_strings:
        raise bad(
            f"stop_token_ids holds {len(ids)} ids, more than {limits.max_stop_strings} "
            f"({flag('max_stop_strings')})",
            "stop_token_ids",
        )


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _get(body: dict[str, Any], name: str, kind: type, default: Any = None) -> Any:
    value = body.get(name)
    if value is None:
        return default
    ok = _is_int(value) if kind is int else isinstance(value, kind)
    if not ok:
        raise bad(f"{name} has the wrong type: {value!r}", name)
    return value


def _refuse_unsupported(body: dict[str, Any]) -> None:
    checks = (
        ("presence_penalty", lambda v: v in (None, 0, 0.0)),
        ("frequency_penalty", lambda v: v in (None, 0, 0.0)),
        ("repetition_penalty", lambda v: v in (None, 1, 1.0)),
        ("logit_bias", lambda v: not v),
        ("use_beam_search", lambda v: not v),
        ("echo", lambda v: not v),
        ("suffix", lambda v: not v),
    )
    for name, allowed in checks:
        if not allowed(body.get(name)):
            raise bad(f"{name} is not supported by this server", name)


def _common(body: dict[str, Any], limits: ServerLimits) -> GenerationRequest:
    _refuse_unsupported(body)
    n = _get(body, "n", int, 1)
    if not 1 <= n <= MAX_N:
        raise bad(f"n must be in [1, {MAX_N}], got {n}", "n")
    _check_stops(body, limits)
    best_of = _get(body, "best_of", int)
    if best_of is not None and best_of != n:
        raise bad("best_of other than n is not supported", "best_of")
    stream = _get(body, "stream", bool, False)
    opts = _get(body, "stream_options", dict)
    if opts is not None and not stream:
        raise bad("stream_options is only allowed when stream is true", "stream_options")
    include_usage = bool(_get(opts or {}, "include_usage", bool, False))
    max_tokens = _get(body, "max_tokens", int)
    if max_tokens is not None and max_tokens < 1:
        raise bad(f"max_tokens must be >= 1, got {max_tokens}", "max_tokens")
    model = _get(body, "model", str)
    if model is not None:
        utf8(model, "model")
    sampling = {k: body[k] for k in _SAMPLING_FIELDS if body.get(k) is not None}
    return GenerationRequest(
        model=model,
        adapters=parse_adapters(body),
        n=n,
        stream=stream,
        include_usage=include_usage,
        max_tokens=max_tokens,
        return_token_ids=_get(body, "return_token_ids", bool, False),
        tokens_as_ids=_get(body, "return_tokens_as_token_ids", bool, False),
        sampling=sampling,
        structured=parse_structured(body, limits),
    )


MAX_COMPOSED_ADAPTERS = 16
# |weight| of one composed adapter. The engine multiplies each B (LoRA scale folded in) by its
# weight and refuses a folded entry above 1e4 (adapters/checks.py: MAX_ADAPTER_WEIGHT, below
# float16's 65504). Trained B entries are O(0.01-1), so weights up to 100 stay far inside that
# and finite in float16 / bfloat16; a delta scaled past 100x its trained size only breaks the
# model, and larger weights made the engine's check fail as if the adapter file were bad.
MAX_COMPOSITION_WEIGHT = 100


def parse_adapters(body: dict[str, Any]) -> list[tuple[str, float]] | None:
    """``"adapters": [{"name": "sql", "weight": 0.7}, ...]``: a per-request composition (the
    weighted sum of those adapters' deltas); None when absent. The engine checks the names,
    the weights' values and the rank budget."""
    value = body.get("adapters")
    if value is None:
        return None
    if not isinstance(value, list) or not value:
        raise bad('adapters must be a non-empty list of {"name": ..., "weight": ...}', "adapters")
    if len(value) > MAX_COMPOSED_ADAPTERS:
        raise bad(f"adapters holds more than {MAX_COMPOSED_ADAPTERS} entries", "adapters")
    out = []
    for i, item in enumerate(value):
        param = f"adapters[{i}]"
        if not isinstance(item, dict) or set(item) - {"name", "weight"}:
            raise bad(f'{param} must be an object with "name" and "weight"', param)
        name, weight = item.get("name"), item.get("weight", 1.0)
        if not isinstance(name, str) or not name:
            raise bad(f"{param}.name must be a non-empty string", f"{param}.name")
        if isinstance(weight, bool) or not isinstance(weight, (int, float)):
            raise bad(f"{param}.weight must be a number", f"{param}.weight")
        # NOTE: an int is compared before float(): 10**400 is valid JSON and overflows it
        if not -MAX_COMPOSITION_WEIGHT <= weight <= MAX_COMPOSITION_WEIGHT:  # (NaN: False)
            raise bad(
                f"{param}.weight must be a finite number in [-{MAX_COMPOSITION_WEIGHT}, "
                f"{MAX_COMPOSITION_WEIGHT}]",
                f"{param}.weight",
            )
        out.append((utf8(name, f"{param}.name"), float(weight)))
    return out


def _prompt_list(value: Any) -> list[str | list[int]]:
    """``prompt``: a string, a list of strings, a list of token ids or a list of such lists."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value:
        if all(_is_int(t) for t in value):
            return [list(value)]
        if all(isinstance(p, str) for p in value):
            return list(value)
        if all(isinstance(p, list) and p and all(_is_int(t) for t in p) for p in value):
            return [list(p) for p in value]
    raise bad(
        "prompt must be a string, a list of strings, a non-empty list of token ids or a list of "
        "such lists",
        "prompt",
    )


def _check_fan_out(prompts: int, n: int, limits: ServerLimits, param: str) -> None:
    if prompts * n > limits.max_prompts_times_n:
        raise bad(
            f"{prompts} prompt(s) × n={n} is {prompts * n} generations, more than "
            f"{limits.max_prompts_times_n} ({flag('max_prompts_times_n')})",
            param,
        )


def parse_completion(body: dict[str, Any], limits: ServerLimits | None = None) -> GenerationRequest:
    limits = limits or ServerLimits()
    for name in ("tools", "tool_choice"):  # chat only
        if body.get(name) not in (None, [], "none"):
            raise bad(f"{name} is not supported by the completions API (use chat)", name)
    req = _common(body, limits)
    if "prompt" not in body:
        raise bad("prompt is required", "prompt")
    prompt = body["prompt"]
    # checked before any per-element work: a list of strings or of id lists is one prompt each
    many = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], (str, list))
    count = len(prompt) if many else 1
    _check_fan_out(count, req.n, limits, "prompt" if count > 1 else "n")
    req.prompts = _prompt_list(prompt)
    texts = [p for p in req.prompts if isinstance(p, str)]
    _check_chars(sum(len(p) for p in texts), limits, "prompt")
    for p in texts:
        utf8(p, "prompt")
    logprobs = _get(body, "logprobs", int)
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        raise bad(f"logprobs must be in [0, {MAX_LOGPROBS}], got {logprobs}", "logprobs")
    req.logprobs = logprobs
    return req


def _message(i: int, m: Any) -> dict[str, Any]:
    param = f"messages[{i}]"
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise bad("each message must be an object with a string role", param)
    utf8(m["role"], f"{param}.role")
    content = m.get("content")
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise bad("only text content parts are supported", f"{param}.content")
            if not isinstance(part.get("text"), str):
                raise bad("a text content part needs a string text", f"{param}.content")
            texts.append(part["text"])
        content = "\n".join(texts)
    elif content is not None and not isinstance(content, str):
        raise bad("content must be a string, a list of text parts or null", f"{param}.content")
    return {**m, "content": content if content is not None else ""}


# Names the renderer binds itself; a template kwarg may not replace them.
_RESERVED_TEMPLATE_KWARGS = frozenset({"self", "messages", "add_generation_prompt"})


def parse_chat(body: dict[str, Any], limits: ServerLimits | None = None) -> GenerationRequest:
    limits = limits or ServerLimits()
    req = _common(body, limits)
    _check_fan_out(1, req.n, limits, "n")
    req.tools = parse_tools(body, limits)
    forced = req.tools.constraint() if req.tools is not None else None
    if forced is not None:
        if req.structured is not None:
            raise bad(
                f"tool_choice {req.tools.choice!r} constrains the output: it cannot be combined "
                f"with {req.structured.field}",
                "tool_choice",
            )
        req.structured = forced
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages must be a non-empty list", "messages")
    # NOTE: every part of a message reaches the chat template, so all of it is bounded here.
    check_depth(messages, limits.max_json_depth, "messages")
    chars = tree_chars(messages, "messages")
    if req.tools is not None:
        chars += req.tools.chars
    req.messages = [_message(i, m) for i, m in enumerate(messages)]
    check_tool_turns(req.messages)
    mct = _get(body, "max_completion_tokens", int)
    if mct is not None:
        if mct < 1:
            raise bad(f"max_completion_tokens must be >= 1, got {mct}", "max_completion_tokens")
        req.max_tokens = mct
    want = _get(body, "logprobs", bool, False)
    top = _get(body, "top_logprobs", int)
    if top is not None and not want:
        raise bad("top_logprobs needs logprobs set to true", "top_logprobs")
    if top is not None and not 0 <= top <= MAX_LOGPROBS:
        raise bad(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {top}", "top_logprobs")
    req.logprobs = (top or 0) if want else None
    kwargs = _get(body, "chat_template_kwargs", dict, {})
    reserved = sorted(_RESERVED_TEMPLATE_KWARGS.intersection(kwargs))
    if reserved:
        raise bad(
            f"chat_template_kwargs may not set {', '.join(reserved)} (the server sets them)",
            "chat_template_kwargs",
        )
    check_depth(kwargs, limits.max_json_depth, "chat_template_kwargs")
    _check_chars(chars + tree_chars(kwargs, "chat_template_kwargs"), limits, "messages")
    req.chat_kwargs = {
        **kwargs,
        "add_generation_prompt": _get(body, "add_generation_prompt", bool, True),
    }
    return req
