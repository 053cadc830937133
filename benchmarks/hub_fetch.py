"""How long the Hugging Face resolver takes to bring one adapter into the staging dir (issue 41,
"from S3 / the Hub, ranged or parallel reads"), against the sha256 time of the same bytes.

A Hub-compatible server on 127.0.0.1 (the cold-load study's, ``HubServer``: its own thread
and event loop) serves rank-16 bf16 adapters of the Llama-3-8B shape (q/k/v/o: 27 MB; all
seven modules: 84 MB), each load a new repo (a fresh digest, nothing in any cache). Two ways
in one run, alternating load by load:

- ``ranged``: what the resolver does (large files as parallel byte ranges straight into the
  destination, ``resolvers/huggingface.py``);
- ``cache``: every file through ``hf_hub_download`` into the Hub cache, then copied into the
  destination (what it did before: force with a part size above the file).

On loopback there is no per-stream network limit, so ``ranged`` gains only the cache's second
write and read; against the real Hub's CDN the parallel ranges matter more (one stream tops
out at tens to a few hundred MB/s).

    python -m benchmarks.hub_fetch [--sizes 27MB 84MB] [--repeats 5]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.load_passes import (
    SIZES,
    adapter_args,
    base_tensors,
    sha256_floor,
    write_adapter,
)
from loraplex.engine.bench.coldload.servers import HubServer, hf_cache_env
from loraplex.engine.bench.synthetic import LLAMA3_8B
from loraplex.engine.model.config import ModelConfig
from loraplex.resolvers import ResolverSettings, SourcePolicy
from loraplex.resolvers import huggingface as hf


async def one_fetch(uri: str, dest: Path, ranged: bool) -> float:
    keep = hf.HF_PART_BYTES
    if not ranged:
        hf.HF_PART_BYTES = 1 << 62  # every file through hf_hub_download and the cache
    try:
        resolver = hf.HuggingFaceResolver(
            ResolverSettings(policy=SourcePolicy(allow=["hf://bench/*"]))
        )
        t0 = time.perf_counter()
        await resolver.fetch(uri, dest)
        return time.perf_counter() - t0
    finally:
        hf.HF_PART_BYTES = keep


async def run(args: argparse.Namespace) -> None:
    mc = ModelConfig.from_dict(LLAMA3_8B)
    work = Path(tempfile.mkdtemp(prefix="hub-fetch-"))
    server = HubServer()
    env = {**server.env, **hf_cache_env(work / "hub-cache")}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    rows = []
    try:
        for size in args.sizes:
            tensors = base_tensors(mc, SIZES[size], args.rank)
            got: dict[str, list[float]] = {"ranged": [], "cache": []}
            floors = []
            for n in range(args.repeats + 1):  # the first pair warms imports: not counted
                for way in ("ranged", "cache") if n % 2 else ("cache", "ranged"):
                    folder = work / f"src-{size}-{n}-{way}"
                    write_adapter(folder, tensors, SIZES[size], args.rank, 2 * n + (way == "cache"))
                    server.add_repo(f"bench/{size}-{n}-{way}", folder)
                    floor, nbytes = sha256_floor(folder)
                    secs = await one_fetch(
                        f"hf://bench/{size}-{n}-{way}",
                        work / f"dst-{size}-{n}-{way}",
                        way == "ranged",
                    )
                    if n:
                        got[way].append(secs / floor)
                        floors.append(floor)
                    shutil.rmtree(folder, ignore_errors=True)
            rows.append(
                (size, nbytes / 1e6, statistics.median(floors) * 1e3,
                 statistics.median(got["cache"]), statistics.median(got["ranged"]))
            )  # fmt: skip
    finally:
        server.stop()
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(work, ignore_errors=True)
    print(
        f"Hub fetch (local server), medians of {args.repeats} fetches; seconds / sha256 of the bytes"
    )
    print("| adapter | sha256 ms | hf_hub_download + cache copy | ranged, straight to dest |")
    print("|---|---:|---:|---:|")
    for size, mb, floor, cache, ranged in rows:
        print(f"| {size} ({mb:.1f} MB) | {floor:.1f} | {cache:.2f} | {ranged:.2f} |")


def main() -> None:
    asyncio.run(run(adapter_args(__doc__).parse_args()))


if __name__ == "__main__":
    main()
