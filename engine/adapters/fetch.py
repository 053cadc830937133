"""Getting an adapter version's files: sources, fetch, verify, preflight, value checks and the
staging directory, the first half of a cold load:

    resolve (plugin, cheap) -> fetch (async I/O into a staging dir) -> verify (sha256 digest)
    -> preflight (config + safetensors header) -> value check of every weight
    -> stage (staging.py: parse and pack into one host-pool region: pinned, shared memory;
    modules_to_save tables, model/lora/full.py, are not in the region: plain CPU tensors of the
    adapter, read in this process)

``AdapterFetcher`` owns sources and the staging directory; ``fetch_and_check`` is the checks
every fetched adapter passes before it is registered, in the engine process or in a loader
process alike (fetch into a fresh folder, sha256 digest against the configured one and, for a
re-fetch, the version's own, header preflight, value check). The stage step is
``AdapterFetcher.stager`` (staging.py).

Where the work runs: with ``loader_processes`` > 0 (the default on CUDA) fetch, verify,
preflight and stage run in helper processes (``loader_procs.py``), so the engine's GIL stays
with the step thread and the event loop; otherwise in threads of this process. The H2D copy
into a GPU slot is the engine's (side stream). Each stage's seconds land in
``version.timings``. Sources are operator configuration: static URIs are allowed one by one,
dynamic names go through plugins / the name template and the allowlist policy.

The staging directory keeps each version's fetched files so a CPU-tier eviction costs no
re-fetch; ``adapter_cache_bytes`` bounds it (LRU over versions no request is using; an evicted
version is fetched again from its pinned source when it is needed again).

One concept (getting the files), ~370 lines: the sources' policy, the two places the checks
run and the staging directory's quota are read together whenever one of them changes.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable
from concurrent import futures
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from loraplex.engine.adapters.added_tokens import check_adapter_vocab
from loraplex.engine.adapters.fetch_pass import fetch_and_check
from loraplex.engine.adapters.host_pool import HostPool
from loraplex.engine.adapters.loader_procs import LoaderInit, LoaderProcesses
from loraplex.engine.adapters.parse import LoRAAdapter
from loraplex.engine.adapters.staging import AdapterStager
from loraplex.engine.adapters.version import AdapterVersion
from loraplex.engine.config import EngineConfig
from loraplex.engine.errors import AdapterConfigError
from loraplex.engine.model.config import ModelConfig
from loraplex.plugins import PluginManager
from loraplex.resolvers import TOKENIZER_FILES, ResolverSettings, SourcePolicy
from loraplex.resolvers.policy import is_local

__all__ = ["AdapterFetcher", "valid_adapter_name", "fetch_and_check"]  # (fetch_pass.py)


_ENV_PREFIXES = ("HF_", "AWS_", "HUGGING")  # what resolvers read at fetch time
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")


def valid_adapter_name(name: str) -> bool:
    """Names clients may use: letters, digits, ``._-``, at most one ``/`` (org/name)."""
    return bool(_NAME.match(name)) and ".." not in name and len(name) <= 200


class AdapterFetcher:
    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        plugins: PluginManager | None = None,
        *,
        pool: HostPool | None = None,
    ) -> None:
        self.config = config
        # the adapter checks' model config: with lora_extra_vocab_size, full tables may have
        # up to that many rows past the base vocabulary (added_tokens.py)
        if config.lora_extra_vocab_size:
            model_config = replace(model_config, lora_extra_vocab_size=config.lora_extra_vocab_size)
        self.model_config = model_config
        # the base's tokenizers.Tokenizer and a loader of an adapter folder's engine Tokenizer
        # (both set by the core; an adapter that added tokens needs them)
        self.base_tokenizer: Any = None
        self.load_tokenizer: Callable[[Path], Any] | None = None
        self.stager = AdapterStager(config, model_config, pool)  # the stage step
        self.procs: LoaderProcesses | None = None
        self._own_plugins = plugins is None  # helpers can rebuild only config-made plugins
        self._helper_plugins: list[str] = []
        # base_policy: what runtime sources (dynamic names, admin loads) must pass; policy adds
        # the operator's static sources, each allowed for its own registration only
        self.base_policy = SourcePolicy(allow=config.allow_sources, local_roots=config.local_roots)
        self.policy = self.base_policy
        settings = ResolverSettings(policy=self.policy)
        self.plugins = plugins or PluginManager(config.enabled_plugins, settings)
        if plugins is not None:
            self.plugins.update_settings(replace(plugins.settings, policy=self.policy))
        self._own_cache = config.adapter_cache_dir is None
        self.cache_dir = Path(config.adapter_cache_dir or tempfile.mkdtemp(prefix="loraplex-"))
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        self._copies: set[futures.Future] = set()  # staging copies being written

    def start_processes(self, count: int) -> None:
        """Start ``count`` loader processes (blocking: at engine start-up, in a worker thread)."""
        if count <= 0:
            return
        init = LoaderInit(
            model_config=self.model_config,
            enabled_plugins=self.config.enabled_plugins,
            settings=self.plugins.settings,
            cache_dir=str(self.cache_dir),
            pool_nbytes=self.pool.nbytes if self.pool is not None else 0,
            threads=max(2, -(-self.config.max_concurrent_loads // count)),
        )
        self.procs = LoaderProcesses(count, init, self.pool.fd if self.pool else None)
        self._helper_plugins = self.plugins.plugin_names
        self.procs.start()
        self.stager.procs = self.procs

    @property
    def pool(self) -> HostPool | None:
        """The host pool the stage step packs into (None: a fresh buffer per load)."""
        return self.stager.pool

    def close(self) -> None:
        if self.procs is not None:
            self.procs.close()
        # staging copies still being written (onepass.py's defer_copy): done before their
        # folders go (bounded: each writes at most one adapter's kept chunks)
        futures.wait(list(self._copies), timeout=60)
        if self._own_cache:
            shutil.rmtree(self.cache_dir, ignore_errors=True)
        self.stager.close()

    # -- sources --------------------------------------------------------------------------------

    async def allow_static(self, uri: str) -> None:
        """Operator-configured sources (``--lora-modules``, admin load) are allowed verbatim
        (a local one at its real path, resolved off the event loop)."""
        allow = SourcePolicy().allowing
        extra = await asyncio.to_thread(allow, [uri]) if is_local(uri) else allow([uri])
        self.policy = self.policy.union(extra)
        self.plugins.update_settings(replace(self.plugins.settings, policy=self.policy))

    def dynamic_uri(self, name: str) -> str | None:
        """Where an unknown adapter name comes from, or None if dynamic loading finds nothing."""
        if not valid_adapter_name(name):
            return None
        uri = self.plugins.resolve_name(name)
        if uri is None and self.config.lora_name_template:
            uri = self.config.lora_name_template.format(name=name)
        return uri

    # -- stages ---------------------------------------------------------------------------------

    async def fetch_verify(
        self,
        v: AdapterVersion,
        sha256: str | None = None,
        *,
        trusted: bool = False,
        stage: tuple[torch.dtype, bool] | None = None,
        background: bool = False,
    ) -> LoRAAdapter | None:
        """resolve + fetch + verify + preflight + value checks, one pass per byte
        (fetch_pass.py); sets ``v.local_dir`` and ``v.digest``. ``stage`` = (dtype, pin): the
        same pass also packs the slot image (into a host-pool region when the engine has a
        pool: sets ``v.region``) and the staged adapter is returned; else None.

        ``trusted``: a static source the operator configured (see ``allow_static``).
        ``background``: no request waits on this pass (add_adapter): it packs only into a
        region free now, and in a loader process it yields to stages requests wait on.
        """
        t = v.timings
        uri = v.uri
        if v.digest and v.pinned_uri and v.pinned_uri != v.uri:
            # NOTE: a re-fetch reads the exact revision first fetched (a moved branch would
            # otherwise fail the digest check forever); it derives from the allowed v.uri
            uri = v.pinned_uri
            await self.allow_static(uri)
        policy = self.policy if trusted else self.base_policy
        if self._fetch_in_helpers():
            payload = {
                "uri": uri,
                "name": v.name,
                "prefix": f"v{v.version}-",
                "sha256": sha256,
                "expect_digest": v.digest,
                "max_bytes": self.config.max_adapter_bytes,
                "max_lora_rank": self.config.max_lora_rank,
                "full_modules": self.config.max_full_module_loras > 0,
                "extra_files": self._extra_files(),
            }
            shared = {  # sent to a helper again only once changed
                "policy": policy if uri == v.uri else self.policy,
                "resolver_policy": self.policy,
                "env": {k: x for k, x in os.environ.items() if k.startswith(_ENV_PREFIXES)},
            }

            async def call(region: tuple[int, int] | None, on_end: Any) -> dict:
                if region is not None:
                    payload["region"] = region
                    payload["dtype"] = str(stage[0]).removeprefix("torch.")  # type: ignore[index]
                    payload["urgent"] = not background
                return await self.procs.call("prepare", payload, shared=shared, on_end=on_end)  # type: ignore[union-attr]

            r, adapter = await self.stager.in_helper(v, call, stage, wait=not background)
            v.local_dir, v.digest, v.seal = Path(r["local_dir"]), r["digest"], r["seal"]
            v.pinned_uri, v.nbytes = r["pinned_uri"], r["nbytes"]
            v.lora_rank, v.dora, v.full = r["rank"], r["dora"], r["full"]
            v.vocab_rows = r["vocab_rows"]
            t.update(r["timings"])
            await self._added_tokens(v, adapter)
            return adapter
        t0 = time.perf_counter()
        resolver = self.plugins.resolver_for(uri)
        await asyncio.to_thread(policy.check, v.uri)
        t1 = time.perf_counter()
        dest = Path(tempfile.mkdtemp(prefix=f"v{v.version}-", dir=self.cache_dir))

        async def run(out: torch.Tensor | None, dtype: torch.dtype | None) -> Any:
            return await fetch_and_check(
                resolver, uri, dest, name=v.name, shown_uri=v.uri, sha256=sha256,
                expect_digest=v.digest, model_config=self.model_config,
                max_lora_rank=self.config.max_lora_rank, max_bytes=self.config.max_adapter_bytes,
                progress=self._progress(v), full_modules=self.config.max_full_module_loras > 0,
                extra_files=self._extra_files(), dtype=dtype, pin=bool(stage and stage[1]),
                out=out, defer_copy=True,
            )  # fmt: skip

        got, adapter = await self.stager.in_thread(v, run, stage, wait=not background)
        report = got.checked.report
        v.local_dir, v.digest, v.pinned_uri, v.nbytes = (
            got.result.local_dir,
            got.digest,
            got.result.pinned_uri,
            got.result.nbytes,
        )
        v.seal, v.copy = got.checked.seal, got.checked.copy  # (copy: lifecycle._fetched)
        if v.copy is not None:
            self._copies.add(v.copy)
            v.copy.add_done_callback(self._copies.discard)
        v.lora_rank, v.dora, v.full = report.rank, report.config.use_dora, bool(report.full)
        v.vocab_rows = report.vocab_rows
        t.update(resolve=t1 - t0, **got.stages)
        await self._added_tokens(v, adapter)
        return adapter

    def _extra_files(self) -> tuple[str, ...]:
        """Files fetched besides the adapter's: its tokenizer, where tokens may be added."""
        return TOKENIZER_FILES if self.config.lora_extra_vocab_size else ()

    async def _added_tokens(self, v: AdapterVersion, adapter: LoRAAdapter | None) -> None:
        """An adapter that added tokens (tables past the base vocabulary): its tokenizer,
        checked against the base's (``v.tokenizer``); on a refusal its files are removed (and
        the region of an image the pass made goes back to the pool)."""
        vocab = self.model_config.vocab_size
        if v.vocab_rows <= vocab:
            v.tokenizer = None
            return
        try:
            if v.dynamic and not v.tokenize_after_load:
                raise AdapterConfigError(
                    f"adapter {v.name!r} adds {v.vocab_rows - vocab} tokens, but its request "
                    "was tokenized before its load: load it ahead (load_lora_adapter, "
                    "--lora-modules), or send requests through AsyncEngine.generate or the "
                    "server, which load such names before tokenizing",
                    field="model",
                )
            await asyncio.to_thread(
                check_adapter_vocab, v.local_dir, self.base_tokenizer, vocab, v.vocab_rows
            )
            assert self.load_tokenizer is not None and v.local_dir is not None
            v.tokenizer = await asyncio.to_thread(self.load_tokenizer, v.local_dir)
        except BaseException:
            if adapter is not None:
                self.stager.release(v)
            if v.local_dir is not None:
                await asyncio.to_thread(shutil.rmtree, v.local_dir, True)
                v.local_dir = None
            raise

    def _fetch_in_helpers(self) -> bool:
        """Helpers rebuild the plugins from configuration: a plugin object registered in this
        process (an embedding app, a test) is not there, so such engines fetch here."""
        return (
            self.procs is not None
            and self._own_plugins
            and self.plugins.plugin_names == self._helper_plugins
        )

    def _progress(self, v: AdapterVersion):
        def report(uri: str, file: str, done: int, total: int | None) -> None:
            v.progress[file] = (done, total)

        return report

    async def trim_staging(
        self, versions: Callable[[], Iterable[AdapterVersion]], keep: AdapterVersion
    ) -> None:
        """Keep the staging directory under ``adapter_cache_bytes``: drop the staged files of
        the least recently used versions that no request uses and no load reads.
        ``versions``: the registry's (asked only when there is a quota: every load ends here,
        and listing thousands of versions per load is the event loop's time)."""
        quota = self.config.adapter_cache_bytes
        if quota is None:
            return
        staged = [
            x
            for x in versions()
            if x.local_dir is not None and self.cache_dir in x.local_dir.parents
        ]
        total = sum(x.nbytes for x in staged)
        idle = [
            x for x in staged
            if x is not keep and x.users == 0 and x.load_task is None and not _writing(x)
        ]  # fmt: skip
        for x in sorted(idle, key=lambda x: x.last_used):
            if total <= quota:
                break
            path, x.local_dir = x.local_dir, None
            total -= x.nbytes
            await asyncio.to_thread(shutil.rmtree, path, True)

    def discard(self, v: AdapterVersion) -> None:
        """Remove a dropped version's staged files (off the event loop; once written, if its
        copy is still being written)."""
        if v.local_dir is not None and self.cache_dir in v.local_dir.parents:
            path = v.local_dir
            v.local_dir = None
            if _writing(v):
                v.copy.add_done_callback(lambda _f: shutil.rmtree(path, ignore_errors=True))
                return
            try:
                asyncio.get_running_loop().run_in_executor(None, shutil.rmtree, path, True)
            except RuntimeError:
                shutil.rmtree(path, ignore_errors=True)


def _writing(v: AdapterVersion) -> bool:
    """``v``'s staging copy is still being written (onepass.py's defer_copy)."""
    return v.copy is not None and not v.copy.done()
