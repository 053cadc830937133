"""Play the Gateway API Inference Extension's endpoint picker against two local loraplex pods.

Starts two ``loraplex serve`` processes (the demo model on CPU, 127.0.0.1, free ports, few GPU
adapter slots each), then sends one scripted sequence of requests for the demo adapters twice,
to fresh pods each time: once round robin, once routed as the picker routes. Before each
request it scrapes both pods' /metrics and scores them with the picker's default scorers:

    queue-scorer                 min-max over vllm:num_requests_waiting (shortest queue: 1)
    kv-cache-utilization-scorer  1 - vllm:kv_cache_usage_perc
    lora-affinity-scorer         from vllm:lora_requests_info: 1.0 the adapter is running
                                 there, 0.8 a free adapter place (running + waiting < max_lora),
                                 0.6 the adapter is waiting there, else 0

weighted (manifests.yaml holds the same weights) and summed; the highest total wins, ties go
to a random one of them (seeded), as the max-score picker does. It prints the cold loads
(``loraplex:adapter_misses{tier="cpu"}``: the adapter in no tier, fetched and parsed) and the
slot loads (``{tier="gpu"}``: written into a GPU slot) of both runs.

    python examples/gateway/picker.py --requests 40 --max-loras 2
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import IO

from prometheus_client.parser import text_string_to_metric_families

POLICIES = ("round-robin", "lora-affinity")
WEIGHTS = {"queue": 1.0, "kv-cache": 1.0, "lora-affinity": 1.0}  # as in manifests.yaml


@dataclass(frozen=True)
class PodMetrics:
    """What the picker's metric extractor keeps of one scrape."""

    waiting: int
    running: int
    kv_usage: float
    max_lora: int
    active: frozenset[str]  # running_lora_adapters
    queued: frozenset[str]  # waiting_lora_adapters


def _names(csv: str) -> frozenset[str]:
    return frozenset(n.strip() for n in csv.split(",") if n.strip())


def read_pod(text: str) -> PodMetrics:
    fams = {f.name: f for f in text_string_to_metric_families(text)}

    def gauge(name: str) -> float:
        return fams[name].samples[0].value

    lora = max(fams["vllm:lora_requests_info"].samples, key=lambda s: s.value)  # the latest
    return PodMetrics(
        waiting=int(gauge("vllm:num_requests_waiting")),
        running=int(gauge("vllm:num_requests_running")),
        kv_usage=gauge("vllm:kv_cache_usage_perc"),
        max_lora=int(lora.labels["max_lora"]),
        active=_names(lora.labels["running_lora_adapters"]),
        queued=_names(lora.labels["waiting_lora_adapters"]),
    )


def lora_affinity(pod: PodMetrics, adapter: str) -> float:
    if adapter in pod.active:
        return 1.0
    if len(pod.active) + len(pod.queued) < pod.max_lora:
        return 0.8
    if adapter in pod.queued:
        return 0.6
    return 0.0


def scores(pods: list[PodMetrics], adapter: str) -> list[float]:
    queues = [p.waiting for p in pods]
    lo, hi = min(queues), max(queues)
    total = []
    for p in pods:
        queue = 1.0 if hi == lo else (hi - p.waiting) / (hi - lo)
        total.append(
            WEIGHTS["queue"] * queue
            + WEIGHTS["kv-cache"] * (1.0 - p.kv_usage)
            + WEIGHTS["lora-affinity"] * lora_affinity(p, adapter)
        )
    return total


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=60) as r:
        return r.read().decode()


def _complete(url: str, model: str, max_tokens: int) -> None:
    body = json.dumps({"model": model, "prompt": "Hello", "max_tokens": max_tokens}).encode()
    req = urllib.request.Request(
        f"{url}/v1/completions", body, {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        r.read()


def _start(args: argparse.Namespace, stack: ExitStack) -> tuple[subprocess.Popen, IO[str]]:
    """A ``loraplex serve`` of the demo model on 127.0.0.1 and a free port (stopped with
    ``stack``)."""
    cmd = [sys.executable, "-m", "loraplex.engine.server.cli", "serve", "--device", "cpu"]
    cmd += ["--host", "127.0.0.1", "--port", "0", "--log-json"]
    cmd += ["--max-loras", str(args.max_loras), "--max-cpu-loras", str(args.max_cpu_loras)]
    log = stack.enter_context(tempfile.TemporaryFile("w+"))  # noqa: SIM115 - the stack closes it
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True)
    stack.callback(_stop, proc)
    return proc, log


def _stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextmanager
def pods(args: argparse.Namespace, n: int = 2) -> Iterator[list[str]]:
    """``n`` fresh pods, started side by side; yields their URLs."""
    with ExitStack() as stack:
        started = [_start(args, stack) for _ in range(n)]
        yield [_serving_url(proc, log) for proc, log in started]


def _serving_url(proc: subprocess.Popen, log: IO[str], timeout: float = 300) -> str:
    """The URL from the server's ``serving`` log line (JSON logs)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        log.seek(0)
        for line in log:
            if '"serving"' in line:
                return json.loads(line)["url"]
        if proc.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"loraplex serve exited:\n{log.read()[-3000:]}")
        time.sleep(0.1)
    raise RuntimeError("loraplex serve did not start in time")


def adapters_of(url: str) -> list[str]:
    cards = json.loads(_get(f"{url}/v1/models"))["data"]
    return sorted(c["id"] for c in cards if c.get("parent"))


def workload(adapters: list[str], n: int, seed: int) -> list[str]:
    """``n`` requests, adapter popularity skewed (weights 1, 1/2, 1/3, ...), seeded."""
    rng = random.Random(seed)
    ranked = rng.sample(adapters, len(adapters))
    weights = [1.0 / (i + 1) for i in range(len(ranked))]
    return rng.choices(ranked, weights, k=n)


def loads(url: str) -> dict[str, float]:
    """This pod's adapter misses per tier so far (cpu: cold loads; gpu: slot loads)."""
    fams = {f.name: f for f in text_string_to_metric_families(_get(f"{url}/metrics"))}
    return {s.labels["tier"]: s.value for s in fams["loraplex:adapter_misses"].samples}


def route(policy: str, urls: list[str], sequence: list[str], args: argparse.Namespace) -> dict:
    """Send ``sequence`` to ``urls`` routed by ``policy``; the loads it caused there."""
    rng = random.Random(args.seed)
    sent: Counter[int] = Counter()
    for i, adapter in enumerate(sequence):
        if policy == "round-robin":
            choice = i % len(urls)
        else:
            view = [read_pod(_get(f"{u}/metrics")) for u in urls]
            total = scores(view, adapter)
            best = max(total)
            choice = rng.choice([k for k, s in enumerate(total) if s == best])
        _complete(urls[choice], adapter, args.max_tokens)
        sent[choice] += 1
    per_pod = [loads(u) for u in urls]
    return {
        "cold": sum(p.get("cpu", 0) for p in per_pod),
        "slot": sum(p.get("gpu", 0) for p in per_pod),
        "sent": [sent[k] for k in range(len(urls))],
    }


def _header(args: argparse.Namespace, adapters: list[str], sequence: list[str]) -> None:
    mix = ", ".join(f"{a} x{n}" for a, n in Counter(sequence).most_common())
    print(
        f"two loraplex pods (demo model, CPU), --max-loras {args.max_loras} "
        f"--max-cpu-loras {args.max_cpu_loras} each"
    )
    print(f"{args.requests} requests over {len(adapters)} adapters (seed {args.seed}): {mix}\n")
    print(f"{'policy':<15}{'cold loads':>11}{'slot loads':>12}{'pod 1':>7}{'pod 2':>7}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--requests", type=int, default=40, help="requests in the sequence")
    p.add_argument("--max-loras", type=int, default=2, help="GPU adapter slots per pod")
    p.add_argument("--max-cpu-loras", type=int, default=2, help="CPU-tier adapters per pod")
    p.add_argument("--max-tokens", type=int, default=4, help="tokens per request")
    p.add_argument("--seed", type=int, default=0, help="the sequence and the picker's ties")
    args = p.parse_args(argv)
    if args.requests < 1 or args.max_loras < 1 or args.max_cpu_loras < args.max_loras:
        p.error("want --requests >= 1, --max-loras >= 1, --max-cpu-loras >= --max-loras")

    results = {}
    for policy in POLICIES:  # fresh pods for each policy: both start from empty tiers
        with pods(args) as urls:
            if not results:
                adapters = adapters_of(urls[0])  # the demo adapters
                sequence = workload(adapters, args.requests, args.seed)
                _header(args, adapters, sequence)
            r = results[policy] = route(policy, urls, sequence, args)
        sent = r["sent"]
        print(f"{policy:<15}{r['cold']:>11.0f}{r['slot']:>12.0f}{sent[0]:>7}{sent[1]:>7}")
    rr, aff = results["round-robin"]["cold"], results["lora-affinity"]["cold"]
    print(f"\ncold loads: lora-affinity {aff:.0f}, round-robin {rr:.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
