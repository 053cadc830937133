"""Hostile adapters against a streaming demo engine (CPU): does another stream keep its pace?

Each round starts a greedy stream on the base model, waits until it decodes steadily, then
registers one hostile adapter as a runtime (untrusted) load and records the stream's worst
inter-token gap while the load is refused, next to its worst gap before it:

- ``redos``: ``target_modules`` = ``(.*){8}z`` (catastrophic backtracking in ``re``)
- ``nan`` / ``huge``: a weight of NaN / 3e38 in ``adapter_model.safetensors``
- ``nested``: ``adapter_config.json`` nested 100,000 levels

    python -m benchmarks.adapter_attacks [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import tempfile
import time
from pathlib import Path

from safetensors.torch import load_file, save_file

from loraplex.engine import AsyncEngine, EngineConfig, SamplingParams
from loraplex.engine.demo import demo_adapters

W, C = "adapter_model.safetensors", "adapter_config.json"


def hostile_adapters(root: Path) -> dict[str, Path]:
    good = demo_adapters()["sql"]

    def variant(name: str) -> Path:
        return Path(shutil.copytree(good, root / name))

    out = {"redos": variant("redos")}
    cfg = {"peft_type": "LORA", "r": 8, "lora_alpha": 32, "target_modules": "(.*){8}z"}
    (out["redos"] / C).write_text(json.dumps(cfg))
    for name, value in (("nan", float("nan")), ("huge", 3e38)):
        out[name] = variant(name)
        tensors = load_file(out[name] / W)
        key = sorted(k for k in tensors if ".lora_B." in k)[0]
        tensors[key] = tensors[key].clone()
        tensors[key][0, 0] = value
        save_file(tensors, str(out[name] / W))
    out["nested"] = variant("nested")
    depth = 100_000
    (out["nested"] / C).write_bytes(
        b'{"peft_type": "LORA", "r": ' + b"[" * depth + b"]" * depth + b"}"
    )
    return out


async def run(rounds: int) -> list[dict]:
    root = Path(tempfile.mkdtemp(prefix="attacks-")) / "root"
    attacks = hostile_adapters(root)
    cfg = EngineConfig(
        device="cpu", dtype="float32", local_roots=(str(root),),
        adapter_cache_dir=str(root.parent / "cache"),
    )  # fmt: skip
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    rows = []
    async with AsyncEngine(cfg) as engine:
        for rnd in range(rounds):
            for name, folder in attacks.items():
                times: list[float] = []

                async def stream(times: list[float] = times) -> None:
                    async for _ in engine.generate([5, 17, 33, 9], params):
                        times.append(time.perf_counter())

                task = asyncio.create_task(stream())
                while len(times) < 15:
                    await asyncio.sleep(0.002)
                t0 = time.perf_counter()
                try:
                    await engine.add_adapter(name, f"file://{folder}", trusted=False)
                    outcome = "ACCEPTED"
                except Exception as e:  # noqa: BLE001 - the typed refusal is the expected result
                    outcome = type(e).__name__
                t1 = time.perf_counter()
                await task
                pairs = list(zip(times, times[1:], strict=False))
                quiet = max(b - a for a, b in pairs[3:14])
                during = max((b - a for a, b in pairs if b >= t0 and a <= t1), default=0.0)
                rows.append(
                    dict(round=rnd, attack=name, outcome=outcome, attack_ms=(t1 - t0) * 1e3,
                         worst_gap_ms=during * 1e3, quiet_worst_ms=quiet * 1e3)
                )  # fmt: skip
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    rows = asyncio.run(run(ap.parse_args().rounds))
    print(
        "| round | attack | outcome | refused in (ms) | worst gap during (ms) | worst gap before (ms) |"
    )
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['round']} | {r['attack']} | {r['outcome']} | {r['attack_ms']:.0f} | "
            f"{r['worst_gap_ms']:.1f} | {r['quiet_worst_ms']:.1f} |"
        )


if __name__ == "__main__":
    main()
