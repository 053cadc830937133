"""Skewed traffic over the demo adapters through a ``loraplex serve-ray`` ingress, then the
ingress's routing decisions per replica (from its /metrics).

    loraplex serve-ray --replicas 2          # in another shell
    python examples/ray_serve/route_adapters.py [--base-url http://127.0.0.1:8000]
"""

from __future__ import annotations

import argparse
import random
import urllib.request
from collections import Counter

from openai import OpenAI


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--requests", type=int, default=40)
    args = ap.parse_args()

    client = OpenAI(base_url=f"{args.base_url}/v1", api_key="unused", max_retries=0)
    adapters = [m.id for m in client.models.list().data if m.parent is not None]
    weights = [1 / (k + 1) ** 1.5 for k in range(len(adapters))]  # Zipf-like: one hot adapter
    rng = random.Random(0)
    sent = Counter()
    for name in rng.choices(adapters, weights, k=args.requests):
        out = client.completions.create(model=name, prompt="Hello", max_tokens=4, temperature=0)
        sent[name] += 1
        print(f"{name:>12} -> {out.choices[0].text!r}")
    print("\nrequests per adapter:", dict(sent.most_common()))

    with urllib.request.urlopen(f"{args.base_url}/metrics", timeout=10) as r:
        metrics = r.read().decode()
    print("\nrouting decisions (replica, tier of the request's adapter there):")
    for line in metrics.splitlines():
        if line.startswith(
            ("loraplex_route_decisions_total{", "loraplex_replica_adapters_resident{")
        ):
            print(" ", line)


if __name__ == "__main__":
    main()
