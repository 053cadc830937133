"""Draft adapters (engine/spec/draft.py): a target adapter's requests draft with the draft
adapter mapped to it, in the draft model's own slots, exactly as HF transformers + PEFT would
decode greedily with that adapter; unmapped adapters and base requests draft with the base, all
in one batch."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from loraplex.engine.model.backend import KernelBackend
from loraplex.engine.request import Request
from loraplex.engine.sampling_params import SamplingParams
from loraplex.engine.spec.draft import DraftProposer
from tests.helpers.adapters import make_dora_adapter
from tests.helpers.models import ALL_MODULES, make_peft_adapter, make_tiny_model
from tests.helpers.peft_oracle import HFReference, compare

K = 5
GREEDY = SamplingParams(temperature=0.0)
PROMPTS = [[1, 17, 33, 92, 5, 200, 41], [1, 250, 3, 8]]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("draft")
    model = make_tiny_model(root / "m", kind="llama", seed=9)
    adapters = {
        "sql": make_peft_adapter(model, root / "sql", r=4, alpha=16, seed=1),
        "poem": make_peft_adapter(model, root / "poem", r=8, target_modules=ALL_MODULES, seed=2),
        "dora": make_dora_adapter(model, root / "dora", r=4, seed=3),
    }
    return model, adapters


@pytest.fixture(scope="module")
def hf(setup):
    return HFReference(*setup)


def request(rid: str, prompt: list[int], adapter: str | None) -> Request:
    version = None if adapter is None else SimpleNamespace(name=adapter)
    return Request(rid, list(prompt), GREEDY, adapter=version)  # type: ignore[arg-type]


# the reference forward, and the GPU forward's structure with torch twins (runs on the CPU)
BACKENDS = ["torch", KernelBackend(fused=True, triton=False)]


@pytest.mark.parametrize("backend", BACKENDS, ids=["torch", "fused-twins"])
def test_draft_adapters_draft_as_peft(setup, hf, backend):
    model, adapters = setup
    # target adapter name -> draft adapter folder; "t-poem2" shares "poem"'s folder (one
    # slot), "t-base" maps to the draft's base
    mapping = {
        "t-sql": adapters["sql"], "t-poem": adapters["poem"], "t-poem2": adapters["poem"],
        "t-dora": adapters["dora"], "t-base": None,
    }  # fmt: skip
    d = DraftProposer(model, num_blocks=64, block_size=4, adapters=mapping, kernel_backend=backend)
    assert d.model.max_loras == 3
    cases = [
        ("t-sql", "sql"), ("t-poem", "poem"), ("t-poem2", "poem"), ("t-dora", "dora"),
        ("t-base", None), ("unmapped", None), (None, None),
    ]  # fmt: skip
    reqs = [
        request(f"r{i}-{j}", p, target)
        for i, (target, _) in enumerate(cases)
        for j, p in enumerate(PROMPTS)
    ]
    props = d.propose(reqs, K)
    i = 0
    for _, draft_adapter in cases:
        for p in PROMPTS:
            ref, gaps = hf.greedy(p, draft_adapter, K)
            compare(props[i].tokens, ref, gaps)
            i += 1
    # the adapters change the drafts (else this test could not tell them apart)
    base = [tuple(props[-2 + j].tokens) for j in range(2)]
    for c in range(4):
        assert [tuple(props[2 * c + j].tokens) for j in range(2)] != base, cases[c]


def test_adapter_rollback_and_sampled_probs(setup):
    """After a partial acceptance an adapter's sampled request drafts from the right context:
    every row of its probabilities is PEFT's softmax at the temperature along its drafts (a
    stale KV position would change them)."""
    import peft
    import transformers

    model, adapters = setup
    mapping = {"t": adapters["poem"]}
    params = SamplingParams(temperature=0.8, seed=5)
    d = DraftProposer(model, num_blocks=64, block_size=4, adapters=mapping)
    r = Request("a", list(PROMPTS[0]), params, adapter=SimpleNamespace(name="t"))
    first = d.propose([r], K)[0]
    r.output_ids += [*first.tokens[:2], (first.tokens[2] + 1) % 256]
    d.commit(r, 2)
    again = d.propose([r], K)[0]
    base = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    peft_model = peft.PeftModel.from_pretrained(base, adapters["poem"]).eval()
    with torch.no_grad():
        for j in range(K):
            ids = torch.tensor([list(r.tokens) + again.tokens[:j]])
            logits = peft_model(input_ids=ids).logits[0, -1].float()
            ref = torch.softmax(logits / params.temperature, -1)
            torch.testing.assert_close(again.probs[j], ref, rtol=1e-4, atol=2e-6)
