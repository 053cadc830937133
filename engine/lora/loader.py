"""The cold-load pipeline of one adapter version, stage by stage:

    resolve (plugin, cheap) -> fetch (async I/O into a staging dir) -> verify (sha256 digest,
    thread) -> preflight (config + safetensors header, thread) -> stage (parse into pinned CPU
    tensors, thread)

The H2D copy into a GPU slot is the engine's (side stream). Each stage's seconds land in
``version.timings``. Sources are operator configuration: static URIs are allowed one by one,
dynamic names go through plugins / the name template and the allowlist policy.
"""

from __future__ import annotations

import asyncio
import re
import shutil
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from loraplex.engine.config import EngineConfig
from loraplex.engine.lora.adapter import LoRAAdapter, load_adapter
from loraplex.engine.lora.digest import adapter_digest
from loraplex.engine.lora.errors import AdapterDigestError, AdapterNotFoundError
from loraplex.engine.lora.manager import AdapterVersion
from loraplex.engine.lora.preflight import preflight
from loraplex.engine.lora.staging import stage_packed
from loraplex.engine.model.config import ModelConfig
from loraplex.plugins import PluginManager
from loraplex.resolvers import ResolverSettings, SourcePolicy

__all__ = ["AdapterLoader", "valid_adapter_name"]

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")


def valid_adapter_name(name: str) -> bool:
    """Names clients may use: letters, digits, ``._-``, at most one ``/`` (org/name)."""
    return bool(_NAME.match(name)) and ".." not in name and len(name) <= 200


class AdapterLoader:
    def __init__(
        self, config: EngineConfig, model_config: ModelConfig, plugins: PluginManager | None = None
    ) -> None:
        self.config = config
        self.model_config = model_config
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

    def close(self) -> None:
        if self._own_cache:
            shutil.rmtree(self.cache_dir, ignore_errors=True)

    # -- sources --------------------------------------------------------------------------------

    def allow_static(self, uri: str) -> None:
        """Operator-configured sources (``--lora-modules``, admin load) are allowed verbatim."""
        self.policy = self.policy.allowing([uri])
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
        self, v: AdapterVersion, sha256: str | None = None, *, trusted: bool = False
    ) -> None:
        """resolve + fetch + verify + preflight; sets ``v.local_dir`` and ``v.digest``.

        ``trusted``: a static source the operator configured (see ``allow_static``).
        """
        t = v.timings
        t0 = time.perf_counter()
        resolver = self.plugins.resolver_for(v.uri)
        await asyncio.to_thread((self.policy if trusted else self.base_policy).check, v.uri)
        t1 = time.perf_counter()
        dest = Path(tempfile.mkdtemp(prefix=f"v{v.version}-", dir=self.cache_dir))
        try:
            result = await resolver.fetch(
                v.uri, dest, self._progress(v), max_bytes=self.config.max_adapter_bytes
            )
            t2 = time.perf_counter()
            digest = await asyncio.to_thread(adapter_digest, result.local_dir)
            if sha256 is not None and sha256.lower().removeprefix("sha256:") != digest:
                raise AdapterDigestError(
                    f"sha256 mismatch for adapter {v.name!r} from {v.uri!r}: configured "
                    f"{sha256.lower()}, content has {digest}",
                    field="sha256",
                )
            if v.digest and v.digest != digest:
                raise AdapterDigestError(
                    f"adapter {v.name!r} at {v.uri!r} changed: digest {digest[:12]}..., "
                    f"expected {v.digest[:12]}...",
                    field="sha256",
                )
            t3 = time.perf_counter()
            await asyncio.to_thread(
                preflight,
                result.local_dir,
                self.model_config,
                max_lora_rank=self.config.max_lora_rank,
                max_bytes=self.config.max_adapter_bytes,
            )
            t4 = time.perf_counter()
        except BaseException:
            await asyncio.to_thread(shutil.rmtree, dest, True)
            raise
        v.local_dir, v.digest, v.pinned_uri, v.nbytes = (
            result.local_dir,
            digest,
            result.pinned_uri,
            result.nbytes,
        )
        t.update(resolve=t1 - t0, fetch=t2 - t1, verify=t3 - t2, preflight=t4 - t3)

    def _progress(self, v: AdapterVersion):
        def report(uri: str, file: str, done: int, total: int | None) -> None:
            v.progress[file] = (done, total)

        return report

    async def stage(self, v: AdapterVersion, dtype: torch.dtype, *, pin: bool) -> LoRAAdapter:
        """Parse the staged files into CPU tensors (pinned when serving on CUDA), in a thread."""
        if v.local_dir is None or not v.local_dir.exists():
            raise AdapterNotFoundError(f"adapter {v.name!r} has no staged files", field="model")

        def work() -> LoRAAdapter:
            t0 = time.perf_counter()
            adapter = load_adapter(
                v.local_dir,
                self.model_config,
                max_lora_rank=self.config.max_lora_rank,
                name=v.name,
                dtype=dtype,
            )
            # one contiguous (pinned) slot image; write_slot copies it in one H2D transfer
            stage_packed(adapter, self.config.max_lora_rank, pin=pin)
            v.timings["stage"] = time.perf_counter() - t0
            return adapter

        return await asyncio.to_thread(work)

    def discard(self, v: AdapterVersion) -> None:
        """Remove a dropped version's staged files (off the event loop)."""
        if v.local_dir is not None and self.cache_dir in v.local_dir.parents:
            path = v.local_dir
            v.local_dir = None
            try:
                asyncio.get_running_loop().run_in_executor(None, shutil.rmtree, path, True)
            except RuntimeError:
                shutil.rmtree(path, ignore_errors=True)
