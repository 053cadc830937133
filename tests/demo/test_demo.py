"""The shipped demo model and adapters: they load in our engine, each adapter visibly changes
the greedy output, the files are what build.py declares, and the builder runs."""

from __future__ import annotations

import asyncio
import hashlib
import json
import subprocess
import sys
from itertools import combinations
from pathlib import Path

import pytest

from loraplex.engine import AsyncEngine, EngineConfig, SamplingParams
from loraplex.engine.demo import build, demo_adapters, demo_model_dir, register_demo_adapters
from loraplex.engine.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[2]
MAX_ASSET_BYTES = 8 << 20


def manifest(folder: Path | None = None) -> dict:
    return json.loads(((folder or demo_model_dir()) / "manifest.json").read_text())


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())


def test_runtime_lookup_imports_no_ml_library() -> None:
    code = (
        "import sys\n"
        "from loraplex.engine.demo import demo_adapters, demo_model_dir\n"
        "assert (demo_model_dir() / 'model.safetensors').is_file()\n"
        "assert len(demo_adapters()) >= 3\n"
        "heavy = {'torch', 'transformers', 'peft'} & set(sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=60)


def test_assets_match_build_declarations() -> None:
    root = demo_model_dir()
    assert read_json(root / "config.json") == build.MODEL_CONFIG
    assert read_json(root / "tokenizer_config.json") == build.tokenizer_config()
    gen = read_json(root / "generation_config.json")
    assert (gen["bos_token_id"], gen["eos_token_id"]) == (build.BOS_ID, build.EOS_ID)
    assert set(demo_adapters()) == set(build.ADAPTERS) and len(build.ADAPTERS) >= 3
    for name, path in demo_adapters().items():
        cfg = read_json(path / "adapter_config.json")
        spec = build.ADAPTERS[name]
        assert cfg["peft_type"] == "LORA" and cfg["r"] == spec["r"]
        assert cfg["lora_alpha"] == spec["lora_alpha"]
        assert cfg["use_rslora"] == spec.get("use_rslora", False)
        targets = spec["target_modules"]
        if isinstance(targets, list):
            assert cfg["target_modules"] == sorted(targets)
        elif targets != "all-linear":
            assert cfg["target_modules"] == targets
        assert sorted(p.name for p in path.iterdir()) == [
            "adapter_config.json",
            "adapter_model.safetensors",
        ]
    m = manifest()
    assert m["quick"] is False and set(m["greedy"]["completion"]) == {"base", *build.ADAPTERS}
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.name != "manifest.json")
    assert {p.relative_to(root).as_posix() for p in files} == set(m["files"])
    for p in files:
        assert hashlib.sha256(p.read_bytes()).hexdigest() == m["files"][p.relative_to(root).as_posix()], p  # fmt: skip
    assert sum(p.stat().st_size for p in root.rglob("*") if p.is_file()) < MAX_ASSET_BYTES


def test_tokenizer_and_chat_template() -> None:
    tok = Tokenizer.from_dir(demo_model_dir())
    assert tok.vocab_size == build.VOCAB_SIZE
    assert (tok.bos_token_id, tok.eos_token_ids) == (build.BOS_ID, {build.EOS_ID})
    ids = tok.encode(build.DEMO_PROMPT)
    assert ids[0] == build.BOS_ID and tok.decode(ids) == build.DEMO_PROMPT
    chat = tok.apply_chat_template([{"role": "user", "content": "Hi?"}])
    assert chat == build.chat_prompt("Hi?")
    assert "Arr" in tok.decode(tok.encode(" Arr, matey! SELECT * FROM users; \u2615"))


async def test_engine_greedy_outputs_differ_per_adapter() -> None:
    """Base and every adapter, completion and chat prompts, all in one batch: the engine's
    greedy text equals the builder's HF reference, and no two outputs are alike."""
    m = manifest()
    params = SamplingParams(max_tokens=m["max_new_tokens"], temperature=0.0)
    cfg = EngineConfig(model=None, device="cpu", dtype="float32", max_loras=len(build.ADAPTERS))

    async def run(engine: AsyncEngine, prompt: str, adapter: str | None) -> str:
        text = ""
        async for out in engine.generate(prompt, params, adapter=adapter):
            text += out.text
        return text

    async with AsyncEngine(cfg) as engine:
        assert await register_demo_adapters(engine) == sorted(build.ADAPTERS)
        tok = engine.tokenizer
        jobs = {}
        for kind, prompt in m["prompts"].items():
            ids = tok.encode(prompt, add_special_tokens=not prompt.startswith("<s>"))
            for name in ["base", *build.ADAPTERS]:
                jobs[kind, name] = run(engine, ids, None if name == "base" else name)
        texts = dict(zip(jobs, await asyncio.gather(*jobs.values()), strict=True))
    for kind in m["prompts"]:
        outs = {name: texts[kind, name] for name in ["base", *build.ADAPTERS]}
        assert outs == m["greedy"][kind]
        for a, b in combinations(outs, 2):
            assert outs[a].strip() != outs[b].strip(), (kind, a, b)
            assert not outs[a].startswith(outs[b]) and not outs[b].startswith(outs[a])
    styles = {"pirate": "Arr", "shakespeare": "thee", "sql": "SELECT", "emoji": "\U0001f44d"}
    for name, marker in styles.items():
        if name in build.ADAPTERS:
            assert marker in texts["completion", name] and marker not in texts["completion", "base"]


def test_quick_build_runs(tmp_path: Path) -> None:
    """The builder end to end in seconds (a few steps), and our loaders accept its output."""
    out = tmp_path / "demo"
    cmd = [sys.executable, "-m", "loraplex.engine.demo.build", "--quick", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    m = manifest(out)
    assert m["quick"] is True and set(m["greedy"]["chat"]) == {"base", *build.ADAPTERS}
    assert read_json(out / "config.json") == build.MODEL_CONFIG
    import torch

    from loraplex.engine.adapters.parse import load_adapter
    from loraplex.engine.model.config import ModelConfig
    from loraplex.engine.model.loader import load_model

    model = load_model(out, dtype=torch.float32, device="cpu")
    assert model.cfg.vocab_size == build.VOCAB_SIZE
    for name in build.ADAPTERS:
        adapter = load_adapter(out / "adapters" / name, ModelConfig.from_dir(out), max_lora_rank=16)
        assert adapter.rank == build.ADAPTERS[name]["r"]
    assert Tokenizer.from_dir(out).chat_template == build.CHAT_TEMPLATE
    # a rebuild may only replace a previous build, never a foreign folder
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "keep.txt").write_text("mine")
    cmd[-1] = str(tmp_path / "other")
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and (tmp_path / "other" / "keep.txt").is_file()


def test_quick_needs_an_output_folder() -> None:
    with pytest.raises(SystemExit):
        build.main(["--quick"])
