"""``loraplex serve``: flags -> EngineConfig, then run the HTTP server until SIGINT / SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import signal
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loraplex.engine.logging import LEVELS
from loraplex.engine.server.limits import ServerLimits, add_limit_arguments, limits_from_args
from loraplex.engine.server.lora_modules import LoraModule, check_lora_modules, parse_lora_module
from loraplex.engine.server.model_source import add_model_arguments, model_arg
from loraplex.engine.server.subcommand import Subcommand

if TYPE_CHECKING:
    from aiohttp import web

    from loraplex.engine.config import EngineConfig

__all__ = [
    "COMMAND",
    "LoraModule",
    "parse_lora_module",
    "check_lora_modules",
    "config_from_args",
    "start_server",
    "shutdown_server",
    "serve_until_stopped",
    "settings_from_args",
]


# EngineConfig.adapter_eviction's names (engine/config.py's ADAPTER_EVICTIONS, which this
# import-light module does not import; a test keeps them equal)
ADAPTER_EVICTIONS = ("lru", "lfu", "gdsf", "gdf")


def _names(text: str) -> list[str]:
    return [n.strip() for n in text.split(",") if n.strip()]


def parse_w8a8_min_tokens(text: str) -> int | str:
    """``--fp8-w8a8-min-tokens``: a token count >= 1, ``auto`` or ``off``."""
    if text in ("auto", "off"):
        return text
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"want a token count >= 1, auto or off, got {text!r}")
    return value


def parse_draft_adapter(text: str) -> tuple[str, str]:
    """``--speculative-draft-adapter NAME=DIR``: a target adapter's name and the draft adapter
    folder its requests draft with."""
    name, eq, folder = text.partition("=")
    if not eq or not name.strip() or not folder.strip():
        raise argparse.ArgumentTypeError(f"want NAME=DIR, got {text!r}")
    return name.strip(), str(Path(folder.strip()).expanduser())


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)  # MODEL, --model, --revision, --download-dir
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="TCP port (0: any free port)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="device")
    dtypes = ("auto", "float32", "bfloat16", "float16")
    p.add_argument("--dtype", choices=dtypes, default="auto", help="weight dtype")
    p.add_argument(
        "--quantization", choices=("fp8",),
        help="fp8: quantize the base projections to float8 e4m3 on load (pre-quantized fp8 "
        "checkpoints are read as fp8 without it); the GEMMs read the fp8 weights on CUDA, the "
        "CPU de-quantizes them",
    )  # fmt: skip
    p.add_argument(
        "--fp8-w8a8-min-tokens", type=parse_w8a8_min_tokens, metavar="N|auto|off",
        help="fp8 base on CUDA: steps of at least N tokens quantize activations per token and "
        "run the fp8 x fp8 GEMM; auto (default): per projection from the size where that "
        "measured faster than the weight-only kernel; off: weight-only at every size",
    )  # fmt: skip
    p.add_argument("--served-model-name", metavar="NAME", help="base model name in the API")
    p.add_argument(
        "--lora-modules", type=parse_lora_module, nargs="+", action="extend", default=[],
        metavar="MODULE",
        help='static adapters: name=URI or \'{"name": ..., "uri": ..., "sha256": ...}\'',
    )  # fmt: skip
    p.add_argument("--max-loras", type=int, help="GPU adapter slots")
    p.add_argument("--max-cpu-loras", type=int, help="adapters held in the host tier")
    p.add_argument(
        "--adapter-eviction", choices=ADAPTER_EVICTIONS, default="lru", metavar="NAME",
        help="which idle adapter a full GPU-slot or host tier gives up: lru (default), lfu "
        "(LFU with ageing), gdsf, gdf (cost-aware: uses x measured reload cost; won the "
        "modeled study); the engine's own study decides the default",
    )  # fmt: skip
    p.add_argument("--max-lora-rank", type=int, help="largest adapter rank served")
    p.add_argument(
        "--max-full-module-loras", type=int, metavar="N",
        help="GPU slots (among the --max-loras) that also hold full embed_tokens / lm_head "
        "tables of adapters with modules_to_save (default 0: such adapters are refused)",
    )  # fmt: skip
    p.add_argument(
        "--max-expert-loras", type=int, metavar="N",
        help="GPU slots (among the --max-loras) that also hold LoRA storage for the experts of "
        "a MoE base: adapters with LoRA on the experts take only those (default: every slot; "
        "0: such adapters are refused)",
    )  # fmt: skip
    p.add_argument(
        "--lora-extra-vocab-size", type=int, metavar="N",
        help="tokens an adapter with full tables may add past the base vocabulary (its "
        "tokenizer.json must extend the base's; needs --max-full-module-loras; default 0)",
    )  # fmt: skip
    p.add_argument("--max-num-seqs", type=int, help="running requests per step")
    p.add_argument("--max-model-len", type=int, help="context length (prompt + output)")
    p.add_argument(
        "--kernel-backend", choices=("auto", "fused", "sgmv", "torch"), default="auto",
        help="LoRA kernels: fused (augmented GEMMs + fused Triton epilogues), sgmv (Triton "
        "shrink/expand), torch (reference); auto: fused on CUDA, torch on CPU",
    )  # fmt: skip
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for decode")
    p.add_argument(
        "--cuda-graph-sizes", type=int, nargs="+", metavar="N",
        help="decode batch sizes captured as CUDA graphs (a step replays the smallest that "
        "holds it; larger steps run eagerly); default 1 2 4 8 16 24 32 48 64 ... up to "
        "--max-num-seqs",
    )  # fmt: skip
    p.add_argument(
        "--mixed-graph-tokens", type=int, metavar="N",
        help="steps of decodes + short prefills (chunks <= 64 tokens, <= N tokens in all) "
        "replay CUDA graphs too (default 256; 0: eager)",
    )  # fmt: skip
    p.add_argument(
        "--loader-processes", type=int, metavar="N",
        help="helper processes that fetch, verify and pack adapters (default: 2 on CUDA, "
        "0 = threads of the server process on CPU)",
    )  # fmt: skip
    p.add_argument("--max-concurrent-loads", type=int, metavar="N", help="cold loads at once")
    p.add_argument(
        "--tensor-parallel-size", type=int, metavar="N",
        help="split the model over N GPUs of this host (N - 1 worker processes, NCCL; on CPU: "
        "processes over gloo); default 1",
    )  # fmt: skip
    p.add_argument("--adapter-cache-dir", metavar="DIR", help="where fetched adapters are staged")
    p.add_argument(
        "--adapter-cache-bytes", type=int, metavar="BYTES",
        help="byte quota of the staging dir (least recently used idle adapters are dropped)",
    )  # fmt: skip
    p.add_argument(
        "--grammar-compile-timeout", type=float, metavar="SECONDS",
        help="budget to compile one new structured-output constraint (in a sandbox process, "
        "killed past it: the request gets a 400); default 10; 0: no budget",
    )  # fmt: skip
    p.add_argument(
        "--grammar-cache-bytes", type=int, metavar="BYTES",
        help="bytes of compiled grammars kept (least recently used dropped first; a constraint "
        "whose grammar alone needs more is refused with a 400); default 1 GiB",
    )  # fmt: skip
    p.add_argument(
        "--grammar-compile-processes", type=int, metavar="N",
        help="sandbox processes compiling new constraints at once (default 2)",
    )  # fmt: skip
    p.add_argument(
        "--no-async-scheduling", action="store_true",
        help="no pipelined decode (the next step waits for the previous step's tokens)",
    )  # fmt: skip
    p.add_argument(
        "--speculative-method", choices=("ngram", "draft"),
        help="speculative decoding: ngram (prompt lookup: the request's own prompt and output "
        "propose), draft (a draft model, --speculative-model); default off. Exact: greedy "
        "output is identical, sampled output distributed as without",
    )  # fmt: skip
    p.add_argument(
        "--num-speculative-tokens", type=int, metavar="K",
        help="tokens proposed per row and step, 1..16 (default 4)",
    )  # fmt: skip
    p.add_argument(
        "--speculative-model", metavar="DIR", help="the draft model's HF folder (--speculative-"
        "method draft; same tokenizer as the served model)",
    )  # fmt: skip
    p.add_argument(
        "--speculative-draft-adapter", type=parse_draft_adapter, action="append",
        metavar="NAME=DIR", dest="speculative_draft_adapters",
        help="requests on adapter NAME draft with the draft model's LoRA adapter in DIR "
        "(--speculative-method draft; repeatable; other requests draft with the draft's base)",
    )  # fmt: skip
    p.add_argument(
        "--speculative-max-running", type=int, metavar="N",
        help="speculate only while at most N requests run (default 8; larger batches are "
        "compute bound)",
    )  # fmt: skip
    p.add_argument(
        "--speculative-min-acceptance", type=float, metavar="A",
        help="per request: stop proposing for a while (4 tokens, doubling up to 64) when its "
        "recent per-position acceptance is below A (default 0.2: break-even of K=4 at a verify "
        "step costing 1.25 decode steps; 0: always propose)",
    )  # fmt: skip
    p.add_argument(
        "--speculative-ngram-min", type=int, metavar="N",
        help="prompt lookup: shortest suffix match that proposes (default 1)",
    )  # fmt: skip
    p.add_argument(
        "--speculative-ngram-max", type=int, metavar="N",
        help="prompt lookup: longest suffix matched (default 4)",
    )  # fmt: skip
    p.add_argument(
        "--admin-token-file", metavar="FILE",
        help="enables POST /v1/load_lora_adapter and /v1/unload_lora_adapter with this token",
    )  # fmt: skip
    p.add_argument(
        "--lora-allow", action="append", default=[], metavar="PATTERN",
        help="glob of remote adapter URIs runtime loads may use (repeatable)",
    )  # fmt: skip
    p.add_argument(
        "--lora-local-root", action="append", default=[], metavar="DIR",
        help="folder local runtime-loaded adapters must lie under (repeatable)",
    )  # fmt: skip
    p.add_argument(
        "--plugins", type=_names, action="extend", metavar="NAME,...",
        help="resolver plugins to enable (default: the built-in ones)",
    )  # fmt: skip
    p.add_argument("--metrics-top-k", type=int, default=16, help="adapters with own metric labels")
    p.add_argument("--log-level", choices=LEVELS, default="info", help="log level")
    p.add_argument("--log-json", action="store_true", help="JSON logs even on a TTY")
    add_limit_arguments(p.add_argument_group("request limits and timeouts"))


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    from loraplex.engine.config import EngineConfig

    model = model_arg(args)
    kw: dict[str, Any] = {
        "model": model,
        "device": args.device,
        "dtype": args.dtype,
        "quantization": args.quantization,
        # NOTE: without a name the demo would be called by its asset folder's path.
        "served_model_name": args.served_model_name or (None if model else "demo"),
        "allow_sources": tuple(args.lora_allow),
        "local_roots": tuple(str(Path(r).expanduser().resolve()) for r in args.lora_local_root),
        "enabled_plugins": tuple(args.plugins) if args.plugins is not None else None,
        "kernel_backend": args.kernel_backend,
        "adapter_eviction": args.adapter_eviction,
        "cuda_graphs": not args.enforce_eager,
        "cuda_graph_sizes": tuple(args.cuda_graph_sizes) if args.cuda_graph_sizes else None,
        "async_scheduling": not args.no_async_scheduling,
    }
    drafts = getattr(args, "speculative_draft_adapters", None)
    if drafts:
        kw["speculative_draft_adapters"] = tuple(drafts)
    w8a8 = getattr(args, "fp8_w8a8_min_tokens", None)
    if w8a8 is not None:
        kw["fp8_w8a8_min_tokens"] = None if w8a8 == "off" else w8a8
    budget = getattr(args, "grammar_compile_timeout", None)
    if budget is not None:
        kw["grammar_compile_timeout_s"] = budget if budget > 0 else None
    for flag in ("grammar_cache_bytes", "grammar_compile_processes"):
        if getattr(args, flag, None) is not None:
            kw[flag] = getattr(args, flag)
    for name in (
        "max_loras", "max_cpu_loras", "max_lora_rank", "max_full_module_loras", "lora_extra_vocab_size",
        "max_expert_loras", "max_num_seqs",
        "max_model_len", "mixed_graph_tokens", "loader_processes", "max_concurrent_loads", "adapter_cache_dir",
        "adapter_cache_bytes", "tensor_parallel_size", "speculative_method",
        "num_speculative_tokens", "speculative_model", "speculative_max_running",
        "speculative_min_acceptance", "speculative_ngram_min", "speculative_ngram_max",
    ):  # fmt: skip
        if getattr(args, name) is not None:
            kw[name] = getattr(args, name)
    return EngineConfig(**kw)


def read_admin_token(path: str) -> str:
    token = Path(path).read_text(encoding="utf-8").strip()
    if not token:
        raise ValueError(f"the admin token file {path} is empty")
    return token


async def start_server(
    app: web.Application,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    limits: ServerLimits | None = None,
) -> tuple[web.AppRunner, int]:
    """Start ``app`` (engine start-up included) on host:port; returns the runner and the port.

    Handlers are cancelled when their client disconnects, so generation stops at once. The app
    decodes request bodies itself (``auto_decompress=False``), within its limits. Timeouts:
    ``limits`` (default: the app's own).
    """
    from aiohttp import web

    from loraplex.engine.server.slow_clients import HeaderDeadline
    from loraplex.engine.server.state import BODY_DECODED_KEY, LIMITS_KEY

    limits = limits or app.get(LIMITS_KEY) or ServerLimits()
    app[BODY_DECODED_KEY] = True
    runner = web.AppRunner(
        app,
        access_log=None,
        handler_cancellation=True,
        auto_decompress=False,
        keepalive_timeout=limits.keep_alive_timeout,
        # after our own drain (shutdown_server) only replies being written are left
        shutdown_timeout=5.0,
    )
    await runner.setup()
    try:
        HeaderDeadline.attach(runner, limits.header_timeout)
        site = web.TCPSite(runner, host, port)
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner, int(runner.addresses[0][1])


async def shutdown_server(runner: web.AppRunner, timeout: float | None = None) -> None:
    """Graceful stop: no new connections or generations, running ones get ``timeout`` seconds
    (default: the app's ``shutdown_timeout``), the rest are aborted, then the runner cleans up
    (engine included when the app owns it)."""
    import structlog

    from loraplex.engine.server.state import DRAIN_KEY, LIMITS_KEY

    log = structlog.get_logger("loraplex.server")
    app = runner.app
    drain = app[DRAIN_KEY]
    drain.close()
    for site in list(runner.sites):
        await site.stop()  # the listening socket closes: nothing new connects
    if timeout is None:
        timeout = app[LIMITS_KEY].shutdown_timeout
    log.info("shutting_down", running=drain.active, timeout_s=timeout)
    if not await drain.wait(timeout):
        aborted = drain.abort_all()
        log.warning("shutdown_aborted_requests", count=aborted, timeout_s=timeout)
        await drain.wait(5.0)  # the aborted replies write their last chunks
    await runner.cleanup()


async def serve_until_stopped(
    app: web.Application,
    host: str,
    port: int,
    *,
    limits: ServerLimits | None = None,
    stop: asyncio.Event | None = None,
    ready: Any = None,
    **log_fields: Any,
) -> None:
    """Serve ``app`` until ``stop`` is set (default: SIGINT / SIGTERM), then shut down
    gracefully; ``ready(url)`` is called once it listens, ``log_fields`` join its log line."""
    import structlog

    runner, bound = await start_server(app, host, port, limits=limits)
    if stop is None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
    url = f"http://{host}:{bound}"
    structlog.get_logger("loraplex.server").info("serving", url=url, **log_fields)
    if ready is not None:
        ready(url)
    try:
        await stop.wait()
    finally:
        await shutdown_server(runner)


def settings_from_args(
    args: argparse.Namespace, *, fetch: bool = True
) -> tuple[EngineConfig, ServerLimits, str | None]:
    """The engine config, server limits and admin token of a serving command's flags, with
    logging configured first; ValueError / OSError for a bad configuration. ``fetch``: a Hub
    or S3 model is downloaded and ``config.model`` names its local folder (model_source.py);
    a ``ModelSourceError`` (a ValueError) says why it could not be."""
    from loraplex.engine.logging import configure_logging
    from loraplex.engine.server.model_source import parse_model_source, resolve_config_model

    configure_logging(args.log_level, True if args.log_json else None)
    config = config_from_args(args)
    revision = getattr(args, "revision", None)
    source = parse_model_source(config.model, revision)  # a bad MODEL fails before anything
    limits = limits_from_args(args)
    names = [config.served_model_name or source.served_name or ""]
    check_lora_modules(args.lora_modules, names)
    token = read_admin_token(args.admin_token_file) if args.admin_token_file else None
    if fetch:
        download_dir = getattr(args, "download_dir", None)
        config = resolve_config_model(config, revision=revision, download_dir=download_dir)
    return config, limits, token


def run(args: argparse.Namespace) -> int:
    import structlog

    from loraplex.engine.server.app import create_app_from_config
    from loraplex.engine.server.memory_estimate import estimate_config, format_table
    from loraplex.engine.server.model_files import ModelSourceError

    log = structlog.get_logger("loraplex.server")
    try:
        config, limits, token = settings_from_args(args, fetch=not args.dry_run)
        if args.dry_run:  # the estimate only: no weights loaded (nor downloaded)
            estimate = estimate_config(config, revision=args.revision, remote=True,
                                       download_dir=args.download_dir)  # fmt: skip
            print(format_table(estimate), flush=True)
            return 0
    except ModelSourceError as e:
        log.error("model_unavailable", error=str(e), kind=type(e).__name__)
        return 2
    except (ValueError, OSError) as e:
        log.error("bad_configuration", error=str(e))
        return 2
    try:
        log.info("memory_estimate", **estimate_config(config).log_fields())
    except Exception as e:  # noqa: BLE001 - the estimate never stops a start-up
        log.warning("memory_estimate_failed", error=str(e), kind=type(e).__name__)
    app = create_app_from_config(
        config,
        admin_token=token,
        lora_modules=args.lora_modules,
        metrics_top_k=args.metrics_top_k,
        limits=limits,
    )
    try:
        asyncio.run(serve_until_stopped(app, args.host, args.port))
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # noqa: BLE001 - start-up failures: one clear line, exit 1
        log.error("serve_failed", error=str(e), kind=type(e).__name__)
        return 1
    return 0


def _add_serve_arguments(p: argparse.ArgumentParser) -> None:
    add_arguments(p)
    p.add_argument(
        "--dry-run", action="store_true",
        help="print the memory estimate (weights, KV cache, LoRA slots, total) and exit "
        "without loading the model or downloading its weights",
    )  # fmt: skip


COMMAND = Subcommand(
    name="serve",
    help="run the OpenAI-compatible server",
    description="Serve MODEL (a folder, a Hugging Face Hub id ORG/NAME[@REVISION], "
    "hf://org/repo[/subdir][@rev] or s3://bucket/prefix; default: the built-in demo model) "
    "with LoRA adapters.",
    add_arguments=_add_serve_arguments,
    run=run,
)
