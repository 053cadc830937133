"""examples/gateway/picker.py runs as its README says (two demo pods on CPU, 127.0.0.1): it
prints the cold loads of both policies, and routing as the picker does costs no more cold
loads than round robin. examples/gateway/manifests.yaml names the extension's resources."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GATEWAY = ROOT / "examples" / "gateway"


def test_picker_prints_cold_loads_of_both_policies() -> None:
    # (two slots per pod, the script's default: affinity settles where ties can go either way)
    cmd = [sys.executable, str(GATEWAY / "picker.py"), "--requests", "12", "--max-loras", "2"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
    out = proc.stdout
    rows = {
        m.group(1): (int(m.group(2)), int(m.group(3)), int(m.group(4)) + int(m.group(5)))
        for m in re.finditer(
            r"^(round-robin|lora-affinity)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)$", out, re.M
        )
    }
    assert set(rows) == {"round-robin", "lora-affinity"}, out
    assert all(sent == 12 for _, _, sent in rows.values()), out
    last = re.search(r"^cold loads: lora-affinity (\d+), round-robin (\d+)$", out, re.M)
    assert last, out
    affinity, round_robin = int(last.group(1)), int(last.group(2))
    assert (affinity, round_robin) == (rows["lora-affinity"][0], rows["round-robin"][0])
    assert 1 <= affinity <= round_robin, out  # some adapter had to load at least once


def test_manifests_name_the_extension_resources() -> None:
    yaml = pytest.importorskip("yaml")
    docs = [d for d in yaml.safe_load_all((GATEWAY / "manifests.yaml").read_text()) if d]
    kinds = {d["kind"]: d for d in docs}
    pool, objective = kinds["InferencePool"], kinds["InferenceObjective"]
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    assert objective["apiVersion"] == "inference.networking.x-k8s.io/v1alpha2"
    assert objective["spec"]["poolRef"]["name"] == pool["metadata"]["name"]
    labels = kinds["Deployment"]["spec"]["template"]["metadata"]["labels"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= labels.items()
    picker = yaml.safe_load(kinds["ConfigMap"]["data"]["endpoint-picker.yaml"])
    assert picker["kind"] == "EndpointPickerConfig"
    types = {p["type"] for p in picker["plugins"]}
    assert {"queue-scorer", "kv-cache-utilization-scorer", "lora-affinity-scorer"} <= types
