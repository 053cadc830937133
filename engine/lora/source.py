"""Where adapters come from: operator-given URIs, verified, then parsed into the CPU tier.

Static adapters (``--lora-modules``, ``AsyncEngine.add_adapter``) are operator configuration;
clients only ever name them.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from urllib.parse import urlparse

import torch

from loraplex.engine.config import EngineConfig
from loraplex.engine.lora.adapter import LoRAAdapter, load_adapter
from loraplex.engine.lora.digest import adapter_digest
from loraplex.engine.lora.errors import AdapterDigestError, AdapterNotFoundError
from loraplex.engine.lora.manager import AdapterVersion
from loraplex.engine.model.config import ModelConfig

__all__ = ["AdapterSource", "local_path"]


def local_path(uri: str) -> Path | None:
    """``file:///abs/dir`` or a plain path -> Path; None for other schemes."""
    parsed = urlparse(uri)
    if parsed.scheme == "file":
        return Path(parsed.path)
    if parsed.scheme == "" or (len(parsed.scheme) == 1 and uri[1:3] == ":\\"):
        return Path(uri)
    return None


class AdapterSource:
    def __init__(self, config: EngineConfig, model_config: ModelConfig) -> None:
        self.config = config
        self.model_config = model_config

    async def verify_static(self, uri: str, sha256: str | None) -> tuple[Path, str]:
        path = local_path(uri)
        if path is None:
            raise AdapterNotFoundError(f"unsupported adapter URI {uri!r}", field="uri")
        if not path.is_dir():
            raise AdapterNotFoundError(f"adapter folder {uri!r} does not exist", field="uri")
        digest = await asyncio.to_thread(adapter_digest, path)
        if sha256 is not None and sha256.lower() != digest:
            raise AdapterDigestError(
                f"sha256 mismatch for {uri!r}: configured {sha256.lower()}, content has {digest}",
                field="sha256",
            )
        return path, digest

    async def load(self, v: AdapterVersion, dtype: torch.dtype, *, pin: bool) -> LoRAAdapter:
        """Parse (and pin) the adapter's tensors off the event loop; checks the digest again."""
        assert v.local_dir is not None

        def work() -> LoRAAdapter:
            t0 = time.perf_counter()
            digest = adapter_digest(v.local_dir)
            if digest != v.digest:
                raise AdapterDigestError(
                    f"adapter {v.name!r} changed on disk since it was registered "
                    f"(digest {digest[:12]}..., expected {v.digest[:12]}...)",
                    field="sha256",
                )
            t1 = time.perf_counter()
            adapter = load_adapter(
                v.local_dir,
                self.model_config,
                max_lora_rank=self.config.max_lora_rank,
                name=v.name,
                dtype=dtype,
            )
            if pin:
                for w in adapter.weights.values():
                    object.__setattr__(w, "a", w.a.pin_memory())
                    object.__setattr__(w, "b", w.b.pin_memory())
            v.timings.update(verify=t1 - t0, stage=time.perf_counter() - t1)
            return adapter

        return await asyncio.to_thread(work)
