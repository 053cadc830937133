"""``l2_prefetch``: a read of a projection's B rows with no output. Under the interpreter (and on
a GPU) it runs over every slot's rank-row run, at a rank bound and over runs that are not a
multiple of its block, changing nothing; B stored column-major is read whole per slot; B whose
slots are not contiguous is refused."""

from __future__ import annotations

import pytest
import torch

from loraplex.engine.model.kernels import l2_prefetch as pf

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _spy(monkeypatch) -> list:
    """The grids of the prefetch launches from now on (each still launched)."""
    seen = []
    real = pf._prefetch_kernel

    class Spy:
        def __getitem__(self, grid):
            seen.append(grid)
            return real[grid]

    monkeypatch.setattr(pf, "_prefetch_kernel", Spy())
    return seen


def _b(slots: int, n: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randn(slots, rank, n, generator=g).to(DEVICE, torch.float16).permute(0, 2, 1)


@pytest.mark.parametrize(("n", "rank", "rows"), [(96, 16, None), (4100, 8, 3), (40, 64, 64)])
def test_prefetch_reads_every_run_and_writes_nothing(monkeypatch, n, rank, rows) -> None:
    b = _b(3, n, rank)
    before, sink = b.clone(), torch.full((1,), 5.0, device=DEVICE)
    seen = _spy(monkeypatch)
    pf.l2_prefetch(b, rows, sink)
    run = (rank if rows is None else min(rows, rank)) * n
    assert seen == [(3, -(-run // (pf.BLOCK * pf.ITERS)))]
    assert torch.equal(b, before) and sink.item() == 5.0


def test_twins_step_and_wrong_layout(monkeypatch) -> None:
    b = _b(2, 64, 8)
    sink = torch.zeros(1, device=DEVICE)
    monkeypatch.setattr(pf, "_prefetch_kernel", None)  # a launch would fail
    pf.l2_prefetch(b, None, sink, triton_kernels=False)
    with pytest.raises(ValueError, match="contiguous"):
        pf.l2_prefetch(b[:, ::2], None, sink)


def test_column_major_slots_are_read_whole(monkeypatch) -> None:
    b = _b(2, 64, 8).contiguous()  # (L, N, R) contiguous
    seen = _spy(monkeypatch)
    pf.l2_prefetch(b, 4, torch.zeros(1, device=DEVICE))
    assert seen == [(2, -(-64 * 8 // (pf.BLOCK * pf.ITERS)))]


def test_a_whole_tensor(monkeypatch) -> None:
    w = torch.randn(50, 130, generator=torch.Generator().manual_seed(1)).to(DEVICE, torch.float16)
    before, sink = w.clone(), torch.full((1,), 5.0, device=DEVICE)
    seen = _spy(monkeypatch)
    pf.l2_prefetch_tensor(w, sink)
    assert seen == [(1, -(-50 * 130 // (pf.BLOCK * pf.ITERS)))]
    assert torch.equal(w, before) and sink.item() == 5.0
    with pytest.raises(ValueError, match="contiguous"):
        pf.l2_prefetch_tensor(w.t(), sink)
