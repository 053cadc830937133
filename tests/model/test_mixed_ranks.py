"""Adapters of different ranks in one batch, in an engine with a larger ``max_lora_rank``
(issue: mixed ranks without padding waste), against HF transformers + PEFT.

The A rows are rank-major (model/lora/layers.py) and a step may read only the prefix of ranks below
its rank bucket (model/lora/ranks.py): these tests run the fused forward at the bucket the decode
graphs would pick, at a tighter bound than max_lora_rank, and on every backend at full rank.
"""

from __future__ import annotations

import functools
import random

import pytest
import torch

from loraplex.engine import model_runner
from loraplex.engine.model.backend import KernelBackend
from loraplex.engine.model.fused import fused_forward
from loraplex.engine.model.lora.ranks import rank_bucket, rank_buckets
from tests.helpers.models import make_peft_adapter, make_tiny_model
from tests.helpers.peft_oracle import MODEL_KINDS, RTOL, half_ok, hf_mixed_batch, ours, rel_err

pytest.importorskip("transformers")
pytest.importorskip("peft")

MAX_RANK = 64
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = {
    "r4": dict(r=4, alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    "r8rs": dict(r=8, alpha=32, use_rslora=True, target_modules=ALL),
    "r12pat": dict(
        r=12,
        alpha=16,
        target_modules=r".*\.(q_proj|v_proj|up_proj|down_proj)",
        rank_pattern={"down_proj": 6},
    ),  # fmt: skip
}
ROWS = [("base", 5), ("r4", 9), ("r8rs", 3), ("r12pat", 12), ("r4", 1), ("base", 7), ("r8rs", 6)]
BACKENDS = {
    "torch": "torch",
    "fused_twins": KernelBackend(fused=True, triton=False),
    "fused": "fused",  # Triton epilogues (interpreted on CPU)
    "sgmv": "sgmv",  # Triton shrink / expand on the strided (rank-major) A view
}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("ranks")
    model_dir = make_tiny_model(root / "base", kind="llama", seed=1, **MODEL_KINDS["llama"])
    adapters = {
        name: make_peft_adapter(model_dir, root / name, seed=20 + i, **kw)
        for i, (name, kw) in enumerate(ADAPTERS.items())
    }
    g = random.Random(5)
    prompts = [[g.randrange(3, 200) for _ in range(n)] for _, n in ROWS]
    names = [n for n, _ in ROWS]
    hf_steps, hf_tokens = hf_mixed_batch(model_dir, adapters, prompts, names)
    return model_dir, adapters, prompts, names, hf_steps, hf_tokens


def _check(our_steps, hf_steps, hf_tokens, what: str) -> None:
    for step, (a, b) in enumerate(zip(our_steps, hf_steps, strict=True)):
        for row in range(a.shape[0]):
            err = rel_err(a[row], b[row])
            assert err < RTOL, f"{what} step {step} row {row}: rel err {err:.2e}"
        assert a.argmax(-1).tolist() == hf_tokens[step]


def _fused_matches_peft(setup, triton: bool, what: str) -> None:
    """The fused forward (twins or Triton) on the oracle batch, against PEFT."""
    model_dir, adapters, prompts, names, hf_steps, hf_tokens = setup
    our_steps = ours(
        model_dir, adapters, prompts, names, hf_tokens, max_rank=MAX_RANK,
        kernel_backend=KernelBackend(fused=True, triton=triton),
    )  # fmt: skip
    _check(our_steps, hf_steps, hf_tokens, what)


def test_rank_buckets() -> None:
    assert rank_buckets(64) == (8, 16, 32, 64)
    assert rank_buckets(16) == (8, 16)
    assert rank_buckets(8) == (8,)
    assert rank_buckets(4) == (4,)
    assert rank_buckets(48) == (8, 16, 32, 48)
    assert [rank_bucket(r, rank_buckets(64)) for r in (0, 1, 8, 9, 16, 17, 64)] == [
        8, 8, 8, 16, 16, 32, 64,
    ]  # fmt: skip


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_mixed_ranks_in_a_larger_engine_match_peft(setup, backend):
    """Ranks 4, 8 and 12 (6 on down_proj) with base rows, in a rank-64 engine: every backend
    at full rank (the eager paths read every rank row)."""
    model_dir, adapters, prompts, names, hf_steps, hf_tokens = setup
    our_steps = ours(
        model_dir, adapters, prompts, names, hf_tokens, max_rank=MAX_RANK,
        kernel_backend=BACKENDS[backend],
    )  # fmt: skip
    _check(our_steps, hf_steps, hf_tokens, backend)


@pytest.mark.parametrize("triton", [False, True])
@pytest.mark.parametrize("bound", [16, 12])
def test_fused_forward_at_a_rank_bound_matches_peft(setup, monkeypatch, triton, bound):
    """The fused forward reading only the A rows of ranks < ``bound`` (16: the bucket the
    graphs pick for rank 12; 12: not a power of two) in a rank-64 engine: the GEMMs read a
    prefix, the epilogues (twins, Triton) loop over ``bound`` rank columns."""
    calls = []

    def bounded(*args, **kw):
        calls.append(1)
        return fused_forward(*args, **kw, rank_bound=bound)

    monkeypatch.setattr(model_runner, "fused_forward", bounded)
    _fused_matches_peft(setup, triton, f"bound {bound} triton={triton}")
    assert calls


def test_a_bound_below_an_adapters_rank_drops_its_rows(setup, monkeypatch):
    """Guard of the test above: a bound of 8 under the rank-12 adapter does change its rows
    (the bound is really applied), and only theirs."""
    model_dir, adapters, prompts, names, hf_steps, hf_tokens = setup
    bound8 = functools.partial(fused_forward, rank_bound=8)
    monkeypatch.setattr(model_runner, "fused_forward", bound8)
    our_steps = ours(
        model_dir, adapters, prompts, names, hf_tokens, max_rank=MAX_RANK,
        kernel_backend=KernelBackend(fused=True, triton=False),
    )  # fmt: skip
    a, b = our_steps[0], hf_steps[0]
    for row, name in enumerate(names):
        err = rel_err(a[row], b[row])
        if name == "r12pat":
            assert err > 1e-3, f"row {row}: a bound of 8 left the rank-12 adapter intact"
        else:
            assert err < RTOL, f"row {row} ({name}): rel err {err:.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_mixed_ranks_through_rank_bucket_graphs_gpu(setup, dtype):
    """On CUDA in half precision: decode through the graph of the step's rank bucket (16, for
    ranks <= 12 in a rank-64 engine) against PEFT in float32 (within PEFT's own half-precision
    error), and against the eager fused step, which reads every rank row."""
    # decode steps: the graph of rank bucket 16 against the full-rank eager step
    _graphs_against_peft_and_eager(setup, dtype, from_step=1)


def _graphs_against_peft_and_eager(setup, dtype, *, from_step=0) -> None:
    """Our CUDA-graph steps against PEFT in float32 (within PEFT's own ``dtype`` error) and
    against our eager steps from step ``from_step`` on."""
    model_dir, adapters, prompts, names, _, _ = setup
    run = dict(model_dir=model_dir, adapters=adapters, prompts=prompts, names=names)
    ref_steps, ref_tokens = hf_mixed_batch(**run, dtype=torch.float32, device="cuda")
    hf_steps, _ = hf_mixed_batch(**run, dtype=dtype, device="cuda", force=ref_tokens)
    kw = dict(dtype=dtype, device="cuda", max_rank=MAX_RANK)
    eager = ours(model_dir, adapters, prompts, names, ref_tokens, **kw, use_cuda_graphs=False)
    graph = ours(model_dir, adapters, prompts, names, ref_tokens, **kw, use_cuda_graphs=True)
    for step in range(len(ref_steps)):
        for row in range(len(prompts)):
            ref = ref_steps[step][row]
            ours_err, hf_err = rel_err(graph[step][row], ref), rel_err(hf_steps[step][row], ref)
            assert half_ok(ours_err, hf_err), (
                f"step {step} row {row}: {ours_err:.2e} vs {hf_err:.2e}"
            )
        if step >= from_step:
            assert rel_err(graph[step], eager[step]) < 1e-2


@pytest.mark.gpu
def test_rank_buckets_are_captured_and_picked_gpu(tmp_path):
    """A rank-64 engine captures decode graphs for rank buckets 8 / 16 / 32 / 64 (never
    above), all writing one logits buffer; a step takes the bucket of its largest rank."""
    from loraplex.engine.adapters.parse import load_adapter
    from loraplex.engine.model.loader import load_model
    from loraplex.engine.model_runner import ModelRunner, StepItem

    model_dir = make_tiny_model(tmp_path / "base", kind="llama", seed=1)
    model = load_model(
        model_dir, dtype=torch.bfloat16, device="cuda", max_loras=2, max_lora_rank=64
    )
    runner = ModelRunner(model, num_blocks=16, block_size=4, max_graph_batch=4)
    graphs = runner.graphs
    assert graphs is not None and graphs.rank_buckets == (8, 16, 32, 64)
    graphs.capture_all()
    assert set(graphs.graphs) == {(b, r) for b in graphs.buckets for r in (8, 16, 32, 64)}
    assert all(out.data_ptr() == graphs.logits.data_ptr() for _, out in graphs.graphs.values())
    for slot, r in enumerate((8, 40)):
        path = make_peft_adapter(model_dir, tmp_path / f"r{r}", seed=r, r=r, alpha=r,
                                 target_modules=ALL)  # fmt: skip
        adapter = load_adapter(path, model.cfg, max_lora_rank=64, dtype=model.dtype)
        runner.write_slot(slot, adapter)
        runner.slot_ranks.set(slot, adapter.rank)  # (the slot store's, when it plans a write)
    assert runner.slot_ranks.ranks == [8, 40]
    seen = []
    real = graphs.run
    graphs.run = lambda *a, **kw: seen.append(graphs.rank_bucket(kw["rank"])) or real(*a, **kw)
    for slots in ([0, -1], [1, 0], [-1, -1]):
        runner.execute([StepItem([3], 0, [i], s) for i, s in enumerate(slots)])
    assert seen == [8, 64, 8]


@pytest.mark.gpu
def test_chosen_graph_sizes_gpu(tmp_path):
    """``graph_sizes`` (EngineConfig.cuda_graph_sizes) are the only batch buckets captured: a
    step replays the smallest that holds it (padding rows), a larger one runs eagerly, and
    both give the eager runner's logits."""
    from loraplex.engine.model.loader import load_model
    from loraplex.engine.model_runner import ModelRunner, StepItem

    model_dir = make_tiny_model(tmp_path / "base", kind="llama", seed=2)
    model = load_model(model_dir, dtype=torch.float32, device="cuda", max_loras=1)
    runner = ModelRunner(model, num_blocks=32, block_size=4, max_graph_batch=8, graph_sizes=(4,))
    eager = ModelRunner(model, num_blocks=32, block_size=4, use_cuda_graphs=False)
    assert runner.graphs is not None and runner.graphs.buckets == (4,)
    runner.graphs.capture_all()
    assert {b for b, _ in runner.graphs.graphs} == {4}
    for rows, graphed in ((3, True), (4, True), (5, False)):
        items = [StepItem([7 + i], 0, [i], -1) for i in range(rows)]
        got = runner.execute(items)
        assert runner.last_was_graph is graphed
        want = eager.execute(items)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
