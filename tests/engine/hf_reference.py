"""Greedy generation with HF transformers + PEFT, one request at a time, as the oracle."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch


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
        full = any(getattr(c, "modules_to_save", None) for c in self.model.peft_config.values())
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
