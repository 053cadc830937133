"""HF-format tokenizer loaded with the ``tokenizers`` library, plus jinja2 chat templates.

Reads ``tokenizer.json`` and ``tokenizer_config.json`` (special tokens, ``add_bos_token``,
``chat_template``), a ``chat_template.jinja`` / ``chat_template.json`` if present, and EOS ids from
``generation_config.json`` / ``config.json``. Does not import transformers.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _Backend

__all__ = ["Tokenizer", "TokenizerError", "TokenizerNotFoundError", "ChatTemplateError"]


class TokenizerError(Exception):
    """Base class of tokenizer errors."""


class TokenizerNotFoundError(TokenizerError):
    """The directory holds no loadable ``tokenizer.json`` (only token-id prompts can be served)."""


class ChatTemplateError(TokenizerError):
    """There is no chat template, or rendering it failed (bad messages, ``raise_exception``)."""


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise TokenizerError(f"{path}: cannot read JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise TokenizerError(f"{path}: expected a JSON object")
    return data


def _token_text(value: Any) -> str | None:
    """A special token from a config: a plain string or an AddedToken dict with ``content``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _id_list(value: Any) -> list[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _pick_template(value: Any) -> str | None:
    """``chat_template`` is a string, or a list of ``{name, template}`` (take ``default``)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        picked = named.get("default") or next(iter(named.values()), None)
        return picked if isinstance(picked, str) else None
    return None


class _GenerationTag(jinja2.ext.Extension):
    """Accepts HF's ``{% generation %}...{% endgeneration %}`` and renders the body as is."""

    tags = {"generation"}

    def parse(self, parser: Any) -> Any:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    return json.dumps(
        value, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class Tokenizer:
    """Encode / decode text and render chat templates for one model."""

    def __init__(
        self,
        backend: _Backend,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        add_bos_token: bool | None = None,
        add_eos_token: bool | None = None,
        chat_template: str | None = None,
        extra_eos_token_ids: list[int] | None = None,
        bos_token_id: int | None = None,
        special_tokens: dict[str, str] | None = None,
    ) -> None:
        self.backend = backend
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.chat_template = chat_template
        self._special_tokens = dict(special_tokens or {})
        self._bos_id = backend.token_to_id(bos_token) if bos_token else None
        if self._bos_id is None:
            self._bos_id = bos_token_id
        self._eos_id = backend.token_to_id(eos_token) if eos_token else None
        eos = set(extra_eos_token_ids or ())
        if self._eos_id is not None:
            eos.add(self._eos_id)
        self._eos_ids = eos
        # What the tokenizer.json post-processor adds on its own, so add_*_token can correct it.
        probe = backend.encode("", add_special_tokens=True).ids
        pp_bos = bool(probe) and self._bos_id is not None and probe[0] == self._bos_id
        pp_eos = bool(probe) and self._eos_id is not None and probe[-1] == self._eos_id
        pp_eos = pp_eos and not (len(probe) == 1 and pp_bos)
        self._fix_bos = 0 if add_bos_token is None else int(add_bos_token) - int(pp_bos)
        self._fix_eos = 0 if add_eos_token is None else int(add_eos_token) - int(pp_eos)

    @classmethod
    def from_dir(cls, path: str | Path, *, chat_template: str | None = None) -> Tokenizer:
        """Load from a model directory; ``chat_template`` overrides the one found there."""
        root = Path(path)
        tok_file = root / "tokenizer.json"
        if not tok_file.is_file():
            hint = (
                " (only tokenizer.model found: convert it)"
                if (root / "tokenizer.model").is_file()
                else ""
            )
            raise TokenizerNotFoundError(f"{root}: no tokenizer.json{hint}")
        try:
            backend = _Backend.from_file(str(tok_file))
        except Exception as exc:  # the Rust side raises plain Exception
            raise TokenizerError(f"{tok_file}: cannot load ({exc})") from exc
        cfg = _read_json(root / "tokenizer_config.json")
        template = chat_template
        if template is None and (root / "chat_template.jinja").is_file():
            template = (root / "chat_template.jinja").read_text(encoding="utf-8")
        if template is None:
            template = _pick_template(_read_json(root / "chat_template.json").get("chat_template"))
        if template is None:
            template = _pick_template(cfg.get("chat_template"))
        gen_cfg = _read_json(root / "generation_config.json")
        model_cfg = _read_json(root / "config.json")
        extra_eos = _id_list(gen_cfg.get("eos_token_id")) + _id_list(model_cfg.get("eos_token_id"))
        bos_id = _id_list(gen_cfg.get("bos_token_id")) or _id_list(model_cfg.get("bos_token_id"))
        names = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token")
        specials = {n: t for n in names if (t := _token_text(cfg.get(n))) is not None}

        def flag(name: str) -> bool | None:
            value = cfg.get(name)
            return value if isinstance(value, bool) else None

        return cls(
            backend,
            bos_token=specials.get("bos_token"),
            eos_token=specials.get("eos_token"),
            add_bos_token=flag("add_bos_token"),
            add_eos_token=flag("add_eos_token"),
            chat_template=template,
            extra_eos_token_ids=extra_eos,
            bos_token_id=bos_id[0] if bos_id else None,
            special_tokens=specials,
        )

    # -- properties ------------------------------------------------------------------------------

    @property
    def eos_token_ids(self) -> set[int]:
        """Every id that ends generation: the tokenizer's EOS plus generation_config's."""
        return set(self._eos_ids)

    @property
    def eos_token_id(self) -> int | None:
        """The tokenizer's own EOS id (else the smallest configured one)."""
        if self._eos_id is not None:
            return self._eos_id
        return min(self._eos_ids) if self._eos_ids else None

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_id

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def has_chat_template(self) -> bool:
        return self.chat_template is not None

    # -- encode / decode -------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; with ``add_special_tokens`` BOS/EOS follow ``add_*_token``."""
        ids = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        return self._fix_specials(ids) if add_special_tokens else ids

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """``[encode(t) for t in texts]``, but the Rust side runs without the GIL.

        NOTE: ``encode`` holds the GIL for the whole call (1 MB of text: ~1 s); call this one
        from a worker thread so that the event loop and the step thread keep running.
        """
        encodings = self.backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)
        if not add_special_tokens:
            return [e.ids for e in encodings]
        return [self._fix_specials(e.ids) for e in encodings]

    def _fix_specials(self, ids: list[int]) -> list[int]:
        """Apply ``add_bos_token`` / ``add_eos_token`` over what the post-processor did."""
        if self._fix_bos > 0 and self._bos_id is not None:
            ids = [self._bos_id, *ids]
        elif self._fix_bos < 0 and ids and ids[0] == self._bos_id:
            ids = ids[1:]
        if self._fix_eos > 0 and self._eos_id is not None:
            ids = [*ids, self._eos_id]
        elif self._fix_eos < 0 and ids and ids[-1] == self._eos_id:
            ids = ids[:-1]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; ids outside the vocab are ignored."""
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    # -- chat ------------------------------------------------------------------------------------

    @cached_property
    def _compiled_template(self) -> jinja2.Template:
        if self.chat_template is None:
            raise ChatTemplateError("this model's tokenizer has no chat template")
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=[_GenerationTag, jinja2.ext.loopcontrols],
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            return env.from_string(self.chat_template)
        except jinja2.exceptions.TemplateError as exc:
            raise ChatTemplateError(f"chat template does not compile: {exc}") from exc

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render ``messages`` to a prompt string (HF semantics; extra kwargs such as ``tools``
        reach the template). The text usually holds BOS already: encode it with
        ``add_special_tokens=False``."""
        template = self._compiled_template
        context: dict[str, Any] = dict(self._special_tokens)
        context.update(kwargs)
        context["messages"] = messages
        context["add_generation_prompt"] = add_generation_prompt
        try:
            return template.render(**context)
        except (jinja2.exceptions.TemplateError, TypeError, ValueError, KeyError) as exc:
            raise ChatTemplateError(f"chat template failed: {exc}") from exc
