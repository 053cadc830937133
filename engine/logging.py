"""Log configuration for the command line: structlog on a TTY console, JSON lines otherwise.

Library code only calls ``structlog.get_logger``; nothing is configured at import. The CLI calls
``configure_logging`` once. Standard-library loggers (aiohttp, asyncio) are rendered by the same
processors, so every line on stderr has one format. Tracebacks are printed without frame
locals (they hold request bodies and prompt text).
"""

from __future__ import annotations

import logging
import sys
from typing import IO

import structlog

__all__ = ["configure_logging", "LEVELS"]

LEVELS = ("debug", "info", "warning", "error", "critical")
_HANDLER_NAME = "loraplex"


def configure_logging(
    level: str | int = "info", json: bool | None = None, stream: IO[str] | None = None
) -> None:
    """Send structlog and stdlib logs to ``stream`` (default stderr) at ``level``.

    ``json``: None picks the console renderer when ``stream`` is a TTY and JSON otherwise.
    Calling it again replaces the previous configuration.
    """
    stream = stream if stream is not None else sys.stderr
    if isinstance(level, str):
        if level.lower() not in LEVELS:
            raise ValueError(f"log level must be one of {', '.join(LEVELS)}, not {level!r}")
        level = getattr(logging, level.upper())
    if json is None:
        json = not (hasattr(stream, "isatty") and stream.isatty())
    shared: list[structlog.types.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    # NOTE: tracebacks without frame locals, which hold request bodies and prompt text: structlog's
    # dict tracebacks and its console renderer (through rich or better_exceptions, when either
    # is installed) print them by default.
    renderer: structlog.types.Processor
    if json:
        renderer = structlog.processors.JSONRenderer()
        no_locals = structlog.tracebacks.ExceptionDictTransformer(show_locals=False)
        shared.append(structlog.processors.ExceptionRenderer(no_locals))
    else:
        renderer = structlog.dev.ConsoleRenderer(
            colors=stream.isatty(), exception_formatter=structlog.dev.plain_traceback
        )
    structlog.configure(
        processors=[
            structlog.stdlib.filter_by_level,
            *shared,
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=False,
    )
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=shared,
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
    )
    handler = logging.StreamHandler(stream)
    handler.set_name(_HANDLER_NAME)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    for old in [h for h in root.handlers if h.get_name() == _HANDLER_NAME]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    # aiohttp's own access log is replaced by the server's one line per request.
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
