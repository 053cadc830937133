"""Deterministic builder of the demo model and its adapters (a dev tool: needs transformers, peft).

    python -m loraplex.engine.demo.build                  # regenerate engine/demo/assets
    python -m loraplex.engine.demo.build --quick --out D  # smoke build into D, seconds

Steps: train a byte-level BPE on all corpora, train a tiny Llama on the base corpus, train one
LoRA per style corpus on top of it, write everything as safetensors + JSON, then record greedy
samples and file hashes in ``manifest.json``. Seeded and single-threaded: same machine, same
library versions, same bytes.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from loraplex.engine.demo import ASSETS_DIR
from loraplex.engine.demo.corpus import Pair, base_pairs, glossary, style_corpus

VOCAB_SIZE = 768
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")
UNK_ID, BOS_ID, EOS_ID = 0, 1, 2
BOS, EOS = SPECIAL_TOKENS[BOS_ID], SPECIAL_TOKENS[EOS_ID]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
MAX_LEN = 128  # training sequence cap, in tokens
MODEL_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "hidden_act": "silu",
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "initializer_range": 0.02,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "bos_token_id": BOS_ID,
    "eos_token_id": EOS_ID,
    "pad_token_id": EOS_ID,
    "torch_dtype": "float32",
}
ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
ADAPTERS: dict[str, dict[str, Any]] = {
    "pirate": {"r": 8, "lora_alpha": 32, "target_modules": ATTN},
    "shakespeare": {"r": 8, "lora_alpha": 16, "target_modules": "all-linear"},
    "sql": {"r": 8, "lora_alpha": 32, "target_modules": ["q_proj", "v_proj", "up_proj", "down_proj"]},
    "emoji": {"r": 8, "lora_alpha": 16, "use_rslora": True, "target_modules": r".*\.(q_proj|v_proj|o_proj|gate_proj|down_proj)"},
}  # fmt: skip
DEMO_PROMPT = "Hello, how are you"
SAMPLE_TOKENS = 24
SEED = 1234


@dataclass(frozen=True)
class Schedule:
    steps: int
    lr: float
    batch: int = 16
    warmup: int = 20


FULL = {"base": Schedule(700, 3e-3), "adapter": Schedule(300, 4e-3)}
QUICK = {"base": Schedule(3, 3e-3, 4, 1), "adapter": Schedule(2, 4e-3, 4, 1)}


def chat_prompt(user: str) -> str:
    """What CHAT_TEMPLATE renders for one user message, with the generation prompt."""
    return f"{BOS}<|user|>\n{user}{EOS}\n<|assistant|>\n"


def texts(pairs: list[Pair]) -> list[str]:
    """Training texts: each dialog as plain text and as a chat; prose as is."""
    out = []
    for prompt, reply in pairs:
        if not prompt:
            out.append(f"{BOS}{reply}{EOS}")
            continue
        out.append(f"{BOS}{prompt} {reply}{EOS}")
        out.append(f"{chat_prompt(prompt)}{reply}{EOS}")
    return out


def base_texts() -> list[str]:
    return texts(base_pairs()) + [f"{BOS}{line}{EOS}" for line in glossary()]


def train_tokenizer() -> Any:
    """Byte-level BPE over every corpus; ``<s>`` is prepended by the post-processor."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token=SPECIAL_TOKENS[UNK_ID]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    corpus = base_texts() + [t for name in ADAPTERS for t in texts(style_corpus(name))]
    tok.train_from_iterator([t.replace(BOS, "").replace(EOS, "") for t in corpus], trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, BOS_ID)]
    )
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == [UNK_ID, BOS_ID, EOS_ID]
    assert tok.get_vocab_size() == VOCAB_SIZE, tok.get_vocab_size()
    return tok


def tokenizer_config() -> dict[str, Any]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "unk_token": SPECIAL_TOKENS[UNK_ID],
        "pad_token": EOS,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MODEL_CONFIG["max_position_embeddings"],
        "chat_template": CHAT_TEMPLATE,
    }


def write_tokenizer(tok: Any, out: Path) -> None:
    tok.save(str(out / "tokenizer.json"))
    _write_json(out / "tokenizer_config.json", tokenizer_config())


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def _encode(tok: Any, items: list[str]) -> list[list[int]]:
    return [tok.encode(t, add_special_tokens=False).ids[:MAX_LEN] for t in items]


def train(model: Any, data: list[list[int]], sched: Schedule, seed: int, tag: str) -> float:
    """AdamW with warmup and cosine decay over shuffled, right-padded batches; last loss."""
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=sched.lr, betas=(0.9, 0.98), weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed)
    order: list[int] = []
    loss_val = float("nan")
    model.train()
    for step in range(sched.steps):
        if len(order) < sched.batch:
            order += torch.randperm(len(data), generator=gen).tolist()
        rows, order = [data[i] for i in order[: sched.batch]], order[sched.batch :]
        width = max(map(len, rows))
        ids = torch.full((len(rows), width), EOS_ID)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, : len(row)] = torch.tensor(row)
            mask[i, : len(row)] = 1
        labels = ids.masked_fill(mask == 0, -100)
        warm = min(1.0, (step + 1) / sched.warmup)
        cos = 0.55 + 0.45 * math.cos(math.pi * step / sched.steps)
        for group in opt.param_groups:
            group["lr"] = sched.lr * warm * cos
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss_val = float(loss.detach())
        if (step + 1) % 100 == 0 or step + 1 == sched.steps:
            print(f"  {tag}: step {step + 1}/{sched.steps} loss {loss_val:.3f}", flush=True)
    model.eval()
    return loss_val


def build_base(tok: Any, out: Path, sched: Schedule) -> Any:
    """Train the base model and write config.json, generation_config.json, model.safetensors."""
    import torch
    import transformers
    from safetensors.torch import save_file

    torch.manual_seed(SEED)
    hf_config = {k: v for k, v in MODEL_CONFIG.items() if k not in ("architectures", "model_type")}
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf_config))
    train(model, _encode(tok, base_texts()), sched, SEED, "base")
    weights = {k: v.detach().contiguous() for k, v in sorted(model.state_dict().items())}
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    _write_json(out / "config.json", MODEL_CONFIG)
    _write_json(out / "generation_config.json", {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID})
    return model


def build_adapter(base: Any, name: str, tok: Any, out: Path, sched: Schedule, seed: int) -> Any:
    """Train one LoRA on ``name``'s corpus; save it as a PEFT folder under ``out``."""
    import peft
    import torch

    torch.manual_seed(seed)
    spec = ADAPTERS[name]
    config = peft.LoraConfig(lora_dropout=0.0, bias="none", task_type="CAUSAL_LM", **spec)
    model = peft.get_peft_model(copy.deepcopy(base), config)
    train(model, _encode(tok, texts(style_corpus(name))), sched, seed, name)
    model.save_pretrained(str(out), safe_serialization=True)
    (out / "README.md").unlink(missing_ok=True)
    cfg = json.loads((out / "adapter_config.json").read_text())
    cfg["base_model_name_or_path"] = "loraplex-demo"
    if isinstance(cfg["target_modules"], list):  # PEFT writes a set: order varies per process
        cfg["target_modules"] = sorted(cfg["target_modules"])
    _write_json(out / "adapter_config.json", cfg)
    return model


def greedy(model: Any, tok: Any, prompt: str, max_new: int = SAMPLE_TOKENS) -> str:
    """HF greedy continuation of ``prompt`` (the reference the engine must reproduce)."""
    import torch

    ids = tok.encode(prompt, add_special_tokens=not prompt.startswith(BOS)).ids
    with torch.no_grad():
        seq = model.generate(
            input_ids=torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=max_new,
            do_sample=False,
            eos_token_id=EOS_ID,
            pad_token_id=EOS_ID,
        )
    return tok.decode(seq[0, len(ids) :].tolist(), skip_special_tokens=True)


def file_hashes(out: Path) -> dict[str, str]:
    """sha256 of every built file (but the manifest), which are also made world-readable."""
    files = sorted(p for p in out.rglob("*") if p.is_file() and p.name != "manifest.json")
    for p in files:
        p.chmod(0o644)
    return {
        p.relative_to(out).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest() for p in files
    }


def _staging(out: Path) -> Path:
    """A fresh sibling folder to build into; refuses to ever replace a foreign ``out``."""
    if out.exists() and any(out.iterdir()) and not (out / "manifest.json").is_file():
        raise SystemExit(f"{out} is not empty and holds no manifest.json: refusing to replace it")
    stage = out.with_name(f".{out.name}.building")
    shutil.rmtree(stage, ignore_errors=True)
    (stage / "adapters").mkdir(parents=True)
    return stage


def _publish(stage: Path, out: Path) -> None:
    """Swap the finished build in, so readers of ``out`` never see a half-written model."""
    old = out.with_name(f".{out.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if out.exists():
        out.rename(old)
    stage.rename(out)
    shutil.rmtree(old, ignore_errors=True)


def build(out: Path, *, quick: bool = False, threads: int = 1) -> dict[str, Any]:
    """Build everything into ``out`` (replaced only once complete); returns the manifest."""
    stage = _staging(out)
    try:
        manifest = _build_into(stage, quick=quick, threads=threads)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    _publish(stage, out)
    return manifest


def _build_into(out: Path, *, quick: bool, threads: int) -> dict[str, Any]:
    import peft
    import tokenizers
    import torch
    import transformers

    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)
    plan = QUICK if quick else FULL
    t0 = time.perf_counter()
    tok = train_tokenizer()
    write_tokenizer(tok, out)
    base = build_base(tok, out, plan["base"])
    prompts = {"completion": DEMO_PROMPT, "chat": chat_prompt(DEMO_PROMPT + "?")}
    samples = {kind: {"base": greedy(base, tok, p)} for kind, p in prompts.items()}
    for i, name in enumerate(ADAPTERS):
        model = build_adapter(base, name, tok, out / "adapters" / name, plan["adapter"], SEED + i)
        for kind, p in prompts.items():
            samples[kind][name] = greedy(model, tok, p)
    manifest = {
        "builder": "python -m loraplex.engine.demo.build" + (" --quick" if quick else ""),
        "quick": quick,
        "seed": SEED,
        "schedule": {k: asdict(v) for k, v in plan.items()},
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "peft": peft.__version__,
            "tokenizers": tokenizers.__version__,
        },
        "prompts": prompts,
        "max_new_tokens": SAMPLE_TOKENS,
        "greedy": samples,
        "files": file_hashes(out),
    }
    _write_json(out / "manifest.json", manifest)
    print(f"built in {time.perf_counter() - t0:.1f}s", flush=True)
    return manifest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m loraplex.engine.demo.build",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--out", type=Path, default=ASSETS_DIR, help="output folder (default: assets)")
    ap.add_argument("--quick", action="store_true", help="a few steps only (smoke test)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: reproducible)")
    args = ap.parse_args(argv)
    if args.quick and args.out == ASSETS_DIR:
        ap.error("--quick needs --out: it must not replace the shipped assets")
    manifest = build(args.out, quick=args.quick, threads=args.threads)
    for kind, by_name in manifest["greedy"].items():
        print(f"greedy {kind} {manifest['prompts'][kind]!r}:")
        for name, text in by_name.items():
            print(f"  {name:>12}: {text!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
