"""Tiny random HF models and PEFT LoRA adapters, made on the fly for tests (no downloads).

``make_tiny_model`` writes a transformers checkpoint (safetensors); ``make_peft_adapter`` wraps
it with peft and writes ``adapter_config.json`` + ``adapter_model.safetensors``.
``write_adapter`` / ``copy_adapter`` write hand-made or edited adapter folders.
Weights are random with a fixed seed and a larger std than HF's default so logits are not flat.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

__all__ = [
    "ALL_MODULES",
    "ATTN_MODULES",
    "TINY_CONFIG",
    "make_tiny_model",
    "make_peft_adapter",
    "write_adapter",
    "copy_adapter",
    "peft_lora_weights",
]

ATTN_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
ALL_MODULES = (*ATTN_MODULES, "gate_proj", "up_proj", "down_proj")
TINY_CONFIG: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=512,
    bos_token_id=1,  # ids of tests/helpers/tokenizers.py
    eos_token_id=2,
)
# Larger than HF's 0.02: logits get a clear argmax (std ~4) and greedy decoding of the tied
# qwen2 model does not just repeat the last token.
WEIGHT_STD = 0.3
EMBED_STD = 0.5  # embeddings and lm_head
LORA_B_STD = 0.1  # with A ~ N(0, 1/in): a delta of ~25 % of a base projection's output


def _config_class(kind: str) -> type:
    import transformers

    classes = {
        "llama": transformers.LlamaConfig,
        "qwen2": transformers.Qwen2Config,
        "mistral": transformers.MistralConfig,
    }
    if kind not in classes:
        raise ValueError(f"kind must be one of {sorted(classes)}, got {kind!r}")
    return classes[kind]


@torch.no_grad()
def _randomise(model: torch.nn.Module, seed: int) -> None:
    """Re-draw every weight from a seeded generator (order: parameter names)."""
    g = torch.Generator().manual_seed(seed)
    for name, p in sorted(model.named_parameters()):
        noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
        if "norm" in name:
            p.copy_(1.0 + 0.1 * noise)  # not all ones, so a dropped norm weight shows
        elif name.endswith("bias"):
            p.copy_(0.02 * noise)
        elif "embed_tokens" in name or "lm_head" in name:
            p.copy_(EMBED_STD * noise)
        else:
            p.copy_(WEIGHT_STD * noise)


def make_tiny_model(
    dir: str | Path,
    kind: str = "llama",
    seed: int = 0,
    *,
    shard: bool | int | str = False,
    **overrides: Any,
) -> Path:
    """Save a tiny random ``kind`` (llama / qwen2 / mistral) causal LM to ``dir``; return it.

    ``overrides`` go to the transformers config class. ``shard``: True splits the weights into
    several safetensors files with an index; an int / str is used as ``max_shard_size``.
    """
    import transformers

    fields = dict(TINY_CONFIG, tie_word_embeddings=kind == "qwen2")
    fields.update(overrides)
    config = _config_class(kind)(**fields)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomise(model, seed)
    if model.config.tie_word_embeddings:
        model.tie_weights()
    out = Path(dir)
    max_shard = "200KB" if shard is True else (shard or "50GB")
    model.save_pretrained(out, max_shard_size=max_shard)
    return out


def make_peft_adapter(
    model_dir: str | Path,
    out_dir: str | Path,
    *,
    r: int = 8,
    alpha: float = 16,
    target_modules: Sequence[str] | str = ATTN_MODULES,
    use_rslora: bool = False,
    rank_pattern: Mapping[str, int] | None = None,
    alpha_pattern: Mapping[str, float] | None = None,
    layers_to_transform: Sequence[int] | int | None = None,
    seed: int = 0,
    added_tokens: Sequence[str] = (),
    **lora_kwargs: Any,
) -> Path:
    """Wrap the base in ``model_dir`` with a peft LoRA, randomise A and B, save to ``out_dir``.

    ``lora_kwargs`` go to ``peft.LoraConfig`` as they are (e.g. ``layers_pattern``).
    ``added_tokens``: as a PEFT user adds tokens: the base's tokenizer gets them
    (``add_tokens``), the base is resized to it (``resize_token_embeddings``) and the tokenizer
    is saved with the adapter (give ``modules_to_save`` the embedding and LM head).
    """
    import peft
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = None
    if added_tokens:
        tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
        tokenizer.add_tokens(list(added_tokens))
        base.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    config = peft.LoraConfig(
        r=r,
        lora_alpha=alpha,
        target_modules=target_modules if isinstance(target_modules, str) else list(target_modules),
        use_rslora=use_rslora,
        rank_pattern=dict(rank_pattern or {}),
        alpha_pattern=dict(alpha_pattern or {}),
        layers_to_transform=(
            list(layers_to_transform)
            if isinstance(layers_to_transform, Sequence)
            else layers_to_transform
        ),
        init_lora_weights=False,
        **lora_kwargs,
    )
    model = peft.get_peft_model(base, config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if ".lora_A." in name:  # (r, in): x @ A.T has unit-ish scale
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)
            elif ".lora_B." in name or ".lora_embedding_B." in name:
                p.copy_(LORA_B_STD * torch.randn(p.shape, generator=g))
            elif ".lora_embedding_A." in name:  # (r, vocab): rows gathered by token id
                p.copy_(torch.randn(p.shape, generator=g))
            elif ".modules_to_save." in name:  # a full table (not the base's copy)
                p.copy_(EMBED_STD * torch.randn(p.shape, generator=g))
    out = Path(out_dir)
    model.save_pretrained(out, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    return out


def write_adapter(
    out_dir: str | Path, config: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]
) -> Path:
    """Write a hand-made adapter folder: ``config`` as JSON and ``tensors`` as safetensors."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "adapter_config.json").write_text(json.dumps(dict(config), indent=2))
    save_file({k: v.contiguous() for k, v in tensors.items()}, out / "adapter_model.safetensors")
    return out


def copy_adapter(
    src: str | Path,
    dst: str | Path,
    *,
    tensors: Mapping[str, torch.Tensor] | None = None,
    **config_changes: Any,
) -> Path:
    """Copy an adapter folder, updating keys of its config and optionally replacing its tensors."""
    from safetensors.torch import load_file

    src, dst = Path(src), Path(dst)
    config = json.loads((src / "adapter_config.json").read_text())
    config.update(config_changes)
    if tensors is None:
        tensors = load_file(src / "adapter_model.safetensors")
    if dst.exists():
        shutil.rmtree(dst)
    return write_adapter(dst, config, tensors)


def peft_lora_weights(
    model_dir: str | Path, adapter_dir: str | Path
) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """(layer, module) -> (A, scale * B) in float32, as PEFT itself holds them after loading."""
    import peft
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(base, adapter_dir)
    out = {}
    for name, mod in model.named_modules():
        if isinstance(mod, peft.tuners.lora.LoraLayer) and "default" in mod.lora_A:
            parts = name.split(".")
            key = (int(parts[parts.index("layers") + 1]), parts[-1])
            b = mod.lora_B["default"].weight.detach() * mod.scaling["default"]
            out[key] = (mod.lora_A["default"].weight.detach(), b)
    return out
