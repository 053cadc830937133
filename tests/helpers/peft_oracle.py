"""HF transformers + PEFT as the oracle of the LoRA tests: the one set-up, shared.

- batch logits: ``hf_mixed_batch`` (a mixed batch with PEFT's ``adapter_names``, prefill and
  ``DECODE_STEPS`` greedy steps), ``hf_rows`` (each adapter's rows as a batch of their own, for
  adapters PEFT cannot mix), ``ours`` (the same rows through our ``ModelRunner``), ``rel_err``,
  ``half_ok``, ``RTOL``, ``MODEL_KINDS`` (the tiny model families);
- greedy generation: ``HFReference`` (one request at a time), ``compare`` (equal up to the first
  near-tie), ``http_greedy_ids`` (the same through the real HTTP server).
"""

from __future__ import annotations

import contextlib
import random
from dataclasses import replace
from pathlib import Path

import torch

from loraplex.engine.adapters.parse import load_adapter
from loraplex.engine.model.loader import load_model
from loraplex.engine.model.lora.full import attach_full_modules
from loraplex.engine.model.lora.slot_buffers import write_slot
from loraplex.engine.model_runner import ModelRunner, StepItem


class HFReference:
    def __init__(self, model_dir: Path, adapters: dict[str, Path]) -> None:
        import peft
        import transformers

        base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        names = list(adapters)
        self.model = peft.PeftModel.from_pretrained(base, adapters[names[0]], adapter_name=names[0])
        for name in names[1:]:
            self.model.load_adapter(adapters[name], adapter_name=name)
        self.model.eval()

    @torch.no_grad()
    def greedy(
        self, prompt: list[int], adapter: str | None, max_tokens: int
    ) -> tuple[list[int], list[float]]:
        """Tokens and, per position, the gap between the top-2 logits."""
        name = adapter or "__base__"
        route = {"adapter_names": [name]}
        # NOTE: PEFT's adapter_names routing skips a modules_to_save table unless the active
        # adapter has it: with such adapters loaded, activate each one (base: adapters off)
        # (and with target_parameters: PEFT's ParamWrapper takes no adapter_names either)
        full = any(
            getattr(c, "modules_to_save", None) or getattr(c, "target_parameters", None)
            for c in self.model.peft_config.values()
        )
        off = contextlib.nullcontext()
        if adapter is not None and (self.model.peft_config[adapter].use_dora or full):
            self.model.set_adapter(adapter)  # PEFT takes no adapter_names with DoRA
            route = {}
        elif adapter is None and full:
            off, route = self.model.disable_adapter(), {}
        with off:
            return self._greedy(prompt, route, max_tokens)

    def _greedy(
        self, prompt: list[int], route: dict, max_tokens: int
    ) -> tuple[list[int], list[float]]:
        ids = torch.tensor([prompt])
        past = None
        tokens, gaps = [], []
        for _ in range(max_tokens):
            out = self.model(input_ids=ids, past_key_values=past, use_cache=True, **route)
            logits = out.logits[0, -1].float()
            top2 = logits.topk(2).values
            gaps.append((top2[0] - top2[1]).item())
            tok = int(logits.argmax())
            tokens.append(tok)
            past = out.past_key_values
            ids = torch.tensor([[tok]])
        return tokens, gaps


def compare(ours: list[int], ref: list[int], gaps: list[float], tol: float = 1e-4) -> int:
    """Assert equality up to the first near-tie of the reference; returns positions cut."""
    for i, (a, b) in enumerate(zip(ours, ref, strict=False)):
        if gaps[i] < tol:
            return len(ref) - i
        assert a == b, f"position {i}: ours {a} != reference {b} (gap {gaps[i]:.2e})"
    assert len(ours) == len(ref)
    return 0


async def http_greedy_ids(engine, model: str, prompt: list[int], n: int) -> list[int]:
    """``n`` greedy token ids of ``prompt`` on ``model`` through the real HTTP server on
    ``engine`` and the official client (loopback)."""
    import openai

    from loraplex.engine.server import create_app, start_server

    runner, port = await start_server(create_app(engine))
    try:
        client = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0
        )
        r = await client.completions.create(
            model=model, prompt=prompt, max_tokens=n, temperature=0.0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )  # fmt: skip
    finally:
        await runner.cleanup()
    return r.choices[0].token_ids


DECODE_STEPS = 3
RTOL = 1e-4


def half_ok(ours_err: float, peft_err: float) -> bool:
    """Half precision on the GPU against PEFT in float32: our error is of the order of the one
    PEFT itself makes in that precision on the same row (adapters with large deltas amplify
    rounding, in PEFT as in ours)."""
    return ours_err <= max(3 * peft_err, 1.5e-2)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b||."""
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


MODEL_KINDS = {
    "llama": dict(
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        }
    ),
    "qwen2": {},
    "mistral": dict(sliding_window=6),
}


def hf_mixed_batch(
    model_dir, adapters, prompts, names, dtype=torch.float32, device="cpu", force=None,
    prepare=None, active=None,
):  # fmt: skip
    """Prefill + greedy decode with PEFT; returns logits per step (B, V) and tokens.

    ``force``: decode these tokens (per step, per row) instead of the greedy ones.
    ``prepare(peft_model)``: called once the adapters are loaded (e.g. to add a weighted one).
    ``active``: run every row on this adapter, without ``adapter_names`` (PEFT refuses mixed
    batches with DoRA adapters).
    """
    import peft
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device)
    first, *rest = adapters
    model = peft.PeftModel.from_pretrained(base, adapters[first], adapter_name=first)
    for name in rest:
        model.load_adapter(adapters[name], adapter_name=name)
    if prepare is not None:
        prepare(model)
    if active is not None:
        model.set_adapter(active)
    model.to(device).eval()
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    hf_names = ["__base__" if n == "base" else n for n in names]
    steps, tokens = [], []
    past = None
    with torch.no_grad():
        for _ in range(DECODE_STEPS + 1):
            out = model(
                input_ids=ids,
                attention_mask=mask,
                position_ids=pos,
                past_key_values=past,
                use_cache=True,
                **({"adapter_names": hf_names} if active is None else {}),
            )
            logits = out.logits[:, -1].float().cpu()
            steps.append(logits)
            nxt = logits.argmax(-1)
            if force is not None:
                nxt = torch.tensor(force[len(tokens)])
            tokens.append(nxt.tolist())
            past = out.past_key_values
            ids = nxt[:, None].to(device)
            mask = torch.cat([mask, torch.ones_like(ids)], dim=1)
            pos = pos[:, -1:] + 1
    return steps, tokens


def ours(
    model_dir, adapters, prompts, names, hf_tokens, dtype=torch.float32, device="cpu",
    loaded=None, max_full=0, extra=0, max_rank=16, graphs=None, **runner_kw,
):  # fmt: skip
    """``adapters``: name -> folder, or (``loaded``) name -> a LoRAAdapter in ``dtype`` (or
    ``loaded(model)`` -> such a dict). ``max_full``: full-table slots (model/lora/full.py), slots
    0..max_full-1 (the last adapters: slots are taken in reverse order); ``extra``: their rows
    past the vocabulary (lora_extra_vocab_size, adapters that added tokens); ``max_rank``: the
    engine's max_lora_rank; ``graphs``: a list that gets, per step, whether it ran as a CUDA
    graph."""
    model = load_model(model_dir, dtype=dtype, device=device, max_loras=4, max_lora_rank=max_rank)
    attach_full_modules(model, max_full, extra)
    mc = replace(model.cfg, lora_extra_vocab_size=extra) if extra else model.cfg
    if callable(loaded):
        loaded = loaded(model)
    runner = ModelRunner(model, num_blocks=64, block_size=4, **runner_kw)
    slots = {}
    # NOTE: slots in reverse order so slot index != adapter order
    for slot, name in enumerate(reversed(list(loaded or adapters))):
        adapter = (loaded or {}).get(name) or load_adapter(
            adapters[name], mc, max_lora_rank=max_rank, name=name, dtype=dtype,
            full_modules=max_full > 0,
        )  # fmt: skip
        write_slot(model, slot, adapter)
        runner.slot_ranks.set(slot, adapter.rank, adapter.dora is not None)
        slots[name] = slot
    free = list(range(64))
    random.Random(0).shuffle(free)  # scattered blocks exercise the paging
    tables = []
    for p in prompts:
        need = (len(p) + DECODE_STEPS + 3) // 4
        tables.append([free.pop() for _ in range(need)])
    items = [
        StepItem(list(p), 0, tables[i], slots.get(names[i], -1)) for i, p in enumerate(prompts)
    ]
    steps = [runner.execute(items).cpu()]
    lens = [len(p) for p in prompts]
    for step in range(DECODE_STEPS):
        items = [
            StepItem([hf_tokens[step][i]], lens[i] + step, tables[i], slots.get(names[i], -1))
            for i in range(len(prompts))
        ]
        steps.append(runner.execute(items).cpu())
        if graphs is not None:
            graphs.append(runner.last_was_graph)
    return steps


def hf_rows(model_dir, adapters, prompts, names, force=None, **kw):
    """``hf_mixed_batch``'s (logits per step, tokens), each adapter's rows run as a batch of
    their own with that adapter active: PEFT's ``adapter_names`` routing skips a
    modules_to_save wrapper unless the model's active adapter has that table (and looks up
    rows of adapters without one by name), so a PEFT mixed batch is no oracle for these rows
    (ours is still one mixed batch)."""
    steps = tokens = None
    for name in dict.fromkeys(names):
        rows = [i for i, n in enumerate(names) if n == name]
        sub = [prompts[i] for i in rows]
        fsub = None if force is None else [[f[i] for i in rows] for f in force]
        active = None if name == "base" else name
        # NOTE: one adapter per PEFT model: PEFT refuses a module that is a LoRA target of one
        # adapter and in modules_to_save of another ("embed" has a LoRA on lm_head)
        one = {name: adapters[name]} if active else dict([next(iter(adapters.items()))])
        s, t = hf_mixed_batch(
            model_dir, one, sub, [name] * len(rows), force=fsub, active=active, **kw
        )
        if steps is None:
            steps = [torch.zeros(len(names), x.shape[1]) for x in s]
            tokens = [[0] * len(names) for _ in s]
        for k, (x, tk) in enumerate(zip(s, t, strict=True)):
            steps[k][rows] = x
            for j, i in enumerate(rows):
                tokens[k][i] = tk[j]
    return steps, tokens
