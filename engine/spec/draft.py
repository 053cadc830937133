"""The draft-model proposer: a small model with the target's tokenizer proposes ``k`` tokens.

The draft is loaded from its own HF folder by the engine's loader and runs through its own
``ModelRunner`` with its own paged KV cache (``draft_kv.DraftBlocks``), optionally with LoRA
adapters of its own: ``adapters`` maps a target adapter's name to the draft adapter folder its
requests draft with (None, or a name not in the map: the draft's base). The draft adapters are
read by the engine's adapter parser and written into the draft model's own slots at
construction (one slot each; plain LoRA and DoRA, no modules_to_save tables).

Per request the draft keeps the KV of a prefix of the request's tokens plus the KV of the
tokens it drafted last (``_Seq.tail``). A proposal of ``k`` tokens for a batch of requests:

1. catch up: each request's tokens the draft has not seen (the prompt at first, later the
   accepted tokens and the verifier's own token), all but the last, run as prefill chunks of
   at most ``max_batched_tokens`` tokens per forward;
2. ``k`` batched single-token steps of all requests together: step 0 feeds each request's
   last token, step j > 0 the token drawn at step j - 1 (read on the device, ``feed_row``: no
   host sync between the steps); each step's logits go through the request's temperature,
   top-k and top-p (``draft_sample``) and one token is drawn from them (greedy rows: argmax);
3. one host transfer of all drafted ids; ``Proposal(tokens, probs)`` with ``probs`` the (k, V)
   float32 distributions the tokens were drawn from (None for greedy rows: a point mass).

After step 2 the draft holds the KV of the request's tokens and of its first ``k - 1``
drafted ones. ``commit`` keeps the accepted drafted positions (those that equal the tokens the
verifier appended) and frees the blocks past them; ``propose`` does the same check first, so a
missed ``commit`` costs a recompute, never a wrong proposal. A request whose tokens hold an id
the draft cannot embed (an adapter's added tokens) gets no proposals; one whose draft KV does
not fit the pool gets none this step.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from loraplex.engine.adapters.checks import fold_dora
from loraplex.engine.adapters.parse import LoRAAdapter, load_adapter, load_magnitudes
from loraplex.engine.model.backend import KernelBackend
from loraplex.engine.model.config import ModelConfig
from loraplex.engine.model.loader import load_model, resolve_dtype
from loraplex.engine.model.lora.dora import row_scales
from loraplex.engine.model_runner import ModelRunner, StepItem
from loraplex.engine.request import Request
from loraplex.engine.sampler import Sampler, make_generator
from loraplex.engine.spec.draft_check import check_draft_vocab
from loraplex.engine.spec.draft_kv import DraftBlocks
from loraplex.engine.spec.draft_sample import draft_probs
from loraplex.engine.spec.proposer import Proposal
from loraplex.engine.tokenizer import Tokenizer, TokenizerError

__all__ = ["DraftProposer", "draft_kv_blocks", "draft_kv_bytes_per_block"]

# a seeded request's draft noise comes from its seed xor this (not the target's own stream)
_DRAFT_SALT = 0x5DEECE66D


def draft_kv_blocks(kv_tokens: int, block_size: int, max_num_seqs: int, k: int) -> int:
    """Draft KV blocks for a target that holds ``kv_tokens`` tokens over at most
    ``max_num_seqs`` requests: every request's tokens plus ``k`` drafted ones, each request's
    last block partly empty."""
    per_seq = -(-k // block_size) + 1
    return -(-kv_tokens // block_size) + max_num_seqs * per_seq


def draft_kv_bytes_per_block(config: ModelConfig, dtype: torch.dtype, block_size: int) -> int:
    """Bytes of one draft KV block (K and V of every layer), known before the draft is
    loaded: start-up sizes the target's KV cache net of the draft's."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim * elem


@dataclass
class _Seq:
    """The draft's state of one request."""

    num_kv: int = 0  # leading tokens of the request whose KV the draft holds
    tail: list[int] = field(default_factory=list)  # drafted tokens whose KV follows them
    generator: torch.Generator | None = None  # a seeded request's own draft noise
    off: bool = False  # its tokens hold an id the draft cannot embed: no proposals


@dataclass
class _Row:
    """One request's share of a proposal."""

    index: int  # in the proposal's request list
    req: Request
    seq: _Seq
    k: int  # tokens it drafts (<= the step's k)
    slot: int  # the draft's LoRA slot, -1: base
    table: list[int]


class DraftProposer:
    """``Proposer`` (``proposer.py``) backed by a small model of the target's vocabulary.

    It runs a model (``runs_model``): the engine calls ``propose`` in its step thread
    (spec/control.py), while ``release`` may come from the event loop at the same time (an
    aborted request): a release during a proposal is applied when the proposal ends."""

    runs_model = True

    def __init__(
        self,
        model_dir: str | Path,
        *,
        num_blocks: int | None,
        target_config: ModelConfig | None = None,
        target_tokenizer: Tokenizer | None = None,
        device: str | torch.device = "cpu",
        dtype: str | torch.dtype = "auto",
        block_size: int = 16,
        adapters: Mapping[str, str | Path | None] | None = None,
        max_lora_rank: int = 64,
        kernel_backend: str | KernelBackend = "auto",
        cuda_graphs: bool = False,
        max_batched_tokens: int = 2048,
        seed: int | None = None,
    ) -> None:
        """Load the draft in ``model_dir`` on ``device``.

        ``target_config`` / ``target_tokenizer``: the target's, checked against the draft's
        (``draft_check``: a ``DraftModelMismatchError`` naming ``--speculative-model``).
        ``num_blocks`` x ``block_size``: the draft's KV cache (``draft_kv_blocks``); None:
        made later by ``allocate`` (start-up loads the draft's weights first, then sizes the
        target's and the draft's caches from the memory left).
        ``adapters``: target adapter name -> draft adapter folder (None: the draft's base);
        ``max_lora_rank``: the largest draft adapter rank accepted. ``kernel_backend``: the
        draft runner's (``model/backend.py``; auto: fused on CUDA). ``cuda_graphs``: capture
        the draft's decode steps (CUDA, fused backend). ``seed``: unseeded requests' draft
        noise (None: torch's default generator).
        """
        path = Path(model_dir)
        self.device = torch.device(device)
        self.config = ModelConfig.from_dir(path)
        if target_config is not None:
            tokenizer = None
            if target_tokenizer is not None:
                try:
                    tokenizer = Tokenizer.from_dir(path)
                except TokenizerError:
                    tokenizer = None  # a folder without tokenizer files: configs checked only
            check_draft_vocab(self.config, target_config, tokenizer, target_tokenizer)
        if isinstance(dtype, str):
            dtype = resolve_dtype(dtype, self.config, self.device.type)
        self.max_batched_tokens = max(1, max_batched_tokens)
        self.max_len = self.config.max_position_embeddings
        self.vocab_size = self.config.vocab_size
        self.block_size = block_size
        self._loaded, self._slots = self._read_adapters(adapters or {}, dtype, max_lora_rank)
        self.model = load_model(
            path, dtype=dtype, device=self.device, max_loras=len(self._loaded),
            max_lora_rank=max((a.rank for a in self._loaded), default=max_lora_rank),
        )  # fmt: skip
        self._runner_kw = dict(use_cuda_graphs=cuda_graphs, kernel_backend=kernel_backend)
        self.runner: ModelRunner | None = None
        self.blocks = DraftBlocks(1, block_size)  # (replaced by ``allocate``)
        self._sampler = Sampler(seed)
        self._seqs: dict[str, _Seq] = {}
        self._lock = threading.Lock()
        self._busy = False  # a proposal is running (``release`` waits for its end)
        self._released: set[str] = set()
        if num_blocks is not None:
            self.allocate(num_blocks)

    def allocate(self, num_blocks: int) -> None:
        """Make the draft's runner with a KV cache of ``num_blocks`` blocks, write the draft
        adapters into its slots and capture its graphs (once, before the first proposal)."""
        if self.runner is not None:
            raise RuntimeError("the draft's KV cache is allocated already")
        runner = ModelRunner(
            self.model, num_blocks=num_blocks, block_size=self.block_size,
            max_model_len=self.max_len, **self._runner_kw,  # type: ignore[arg-type]
        )  # fmt: skip
        for slot, adapter in enumerate(self._loaded):
            if adapter.config.use_dora:  # row scales against the draft's own base weights
                mags = load_magnitudes(adapter.path, self.config)
                fold_dora(adapter, row_scales(self.model, adapter.name, adapter.weights, mags))
            runner.write_slot(slot, adapter)
            runner.slot_ranks.set(slot, adapter.rank, adapter.dora is not None)
        self._loaded = []  # (in the slots now)
        if runner.graphs is not None:
            runner.graphs.capture_all()
        self.runner = runner
        self.blocks = DraftBlocks(num_blocks, self.block_size)

    def _read_adapters(
        self, adapters: Mapping[str, str | Path | None], dtype: torch.dtype, max_rank: int
    ) -> tuple[list[LoRAAdapter], dict[str, int]]:
        """Each distinct draft adapter folder read once (its slot: its index), and target
        adapter name -> draft slot."""
        loaded: list[LoRAAdapter] = []
        by_folder: dict[Path, int] = {}
        slots: dict[str, int] = {}
        for target, folder in adapters.items():
            if folder is None:
                continue
            key = Path(folder).resolve()
            if key not in by_folder:
                by_folder[key] = len(loaded)
                loaded.append(load_adapter(key, self.config, max_lora_rank=max_rank, dtype=dtype))
            slots[target] = by_folder[key]
        return loaded, slots

    # -- the Proposer protocol ----------------------------------------------------------------

    def propose(self, reqs: Sequence[Request], k: int) -> list[Proposal]:
        """Up to ``k`` drafted tokens per request, drawn from the draft's distribution after
        each request's sampling transforms (see the module docstring)."""
        self._ready()
        with self._lock:
            self._busy = True
        try:
            return self._propose(reqs, k)
        finally:
            with self._lock:
                self._busy = False
                for rid in self._released:
                    self._drop(rid)
                self._released.clear()

    def _propose(self, reqs: Sequence[Request], k: int) -> list[Proposal]:
        out = [Proposal() for _ in reqs]
        rows: list[_Row] = []
        catch_up: list[tuple[_Row, int]] = []  # (row, first token to prefill)
        for i, req in enumerate(reqs):
            row, start = self._prepare(i, req, k)
            if row is not None:
                rows.append(row)
                catch_up.append((row, start))
        if not rows:
            return out
        self._prefill(catch_up)
        # the rows still drafting at step j are a prefix: row r's step-j input is its own
        # step-(j - 1) output, row r of the previous step
        rows.sort(key=lambda r: -r.k)
        drawn, probs = self._draft(rows)
        flat = torch.cat(drawn).tolist()
        offsets = [0]
        for step in drawn:
            offsets.append(offsets[-1] + len(step))
        sampled = [r for r in rows if not r.req.params.greedy]
        rank = {id(r): j for j, r in enumerate(sampled)}
        for r, row in enumerate(rows):
            tokens = [int(flat[offsets[j] + r]) for j in range(row.k)]
            p = None
            if id(row) in rank:
                p = torch.stack([probs[j][rank[id(row)]] for j in range(row.k)])
            out[row.index] = Proposal(tokens, p)
            row.seq.tail = tokens[:-1]  # their KV was written by steps 1 .. k - 1
        return out

    def commit(self, req: Request, num_accepted: int) -> None:
        """Keep the KV of the accepted drafted positions, free the blocks past them."""
        seq = self._seqs.get(req.request_id)
        if seq is not None:
            self._reconcile(req, seq, num_accepted)

    def release(self, req: Request) -> None:
        """Drop the request's draft KV and state (at the end of a running proposal)."""
        with self._lock:
            if self._busy:
                self._released.add(req.request_id)
            else:
                self._drop(req.request_id)

    def _drop(self, request_id: str) -> None:
        self._seqs.pop(request_id, None)
        self.blocks.free(request_id)

    # -- pieces -------------------------------------------------------------------------------

    def _reconcile(self, req: Request, seq: _Seq, limit: int | None = None) -> None:
        """The drafted tail's KV is kept as far as it equals the request's tokens (at most
        ``limit`` positions); the rest is dropped and its blocks freed."""
        keep, tokens = 0, req.tokens
        end = min(len(seq.tail), len(tokens) - seq.num_kv)
        if limit is not None:
            end = min(end, max(0, limit))
        while keep < end and seq.tail[keep] == tokens[seq.num_kv + keep]:
            keep += 1
        seq.num_kv += keep
        seq.tail = []
        self.blocks.truncate(req.request_id, seq.num_kv)

    def _prepare(self, index: int, req: Request, k: int) -> tuple[_Row | None, int]:
        """The request's row of this proposal and the first token it must prefill; None: no
        proposal for it."""
        seq = self._seqs.get(req.request_id)
        if seq is None:
            seq = self._seqs[req.request_id] = _Seq()
            if req.params.seed is not None:
                seq.generator = make_generator(req.params.seed ^ _DRAFT_SALT, self.device)
        if seq.off:
            return None, 0
        self._reconcile(req, seq)
        n = req.num_tokens
        kk = min(k, self.max_len - n)
        if kk <= 0:
            return None, 0
        start = min(seq.num_kv, n - 1)  # the last token is always fed again: its logits
        new = req.tokens[start:n]
        if max(new) >= self.vocab_size or min(new) < 0:
            seq.off = True  # (an adapter's added token: the draft cannot embed it)
            self.blocks.free(req.request_id)
            return None, 0
        # KV of positions 0 .. n + kk - 2: the request's tokens and kk - 1 drafted ones
        if not self.blocks.reserve(req.request_id, n + kk - 1):
            return None, 0
        seq.num_kv = start
        table = self.blocks.table(req.request_id)
        return _Row(index, req, seq, kk, self._slot(req), table), start

    def _ready(self) -> ModelRunner:
        if self.runner is None:
            raise RuntimeError("the draft's KV cache is not allocated (DraftProposer.allocate)")
        return self.runner

    def _slot(self, req: Request) -> int:
        return -1 if req.adapter is None else self._slots.get(req.adapter.name, -1)

    def _prefill(self, catch_up: list[tuple[_Row, int]]) -> None:
        """Each row's unseen tokens but its last, in forwards of at most
        ``max_batched_tokens`` tokens (a row may span several)."""
        budget = self.max_batched_tokens
        items: list[StepItem] = []
        used = 0
        for row, start in catch_up:
            end = row.req.num_tokens - 1
            pos = start
            while pos < end:
                take = min(end - pos, budget - used)
                ids = row.req.tokens[pos : pos + take]
                items.append(StepItem(ids, pos, row.table, row.slot))
                pos += take
                used += take
                if used == budget:
                    self._ready().execute(items)  # (logits unused: the last rows' only)
                    items, used = [], 0
            row.seq.num_kv = end
        if items:
            self._ready().execute(items)

    def _draft(self, rows: list[_Row]) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        """The k batched draft steps: per step the drawn ids of its rows (on the device) and
        the probabilities of its sampled (non-greedy) rows, in row order."""
        drawn: list[torch.Tensor] = []
        probs: list[torch.Tensor | None] = []
        prev: torch.Tensor | None = None
        for j in range(rows[0].k):
            active = [r for r in rows if r.k > j]
            items = []
            for r, row in enumerate(active):
                pos = row.req.num_tokens - 1 + j
                if j == 0:
                    items.append(StepItem([row.req.tokens[pos]], pos, row.table, row.slot))
                else:
                    items.append(StepItem([0], pos, row.table, row.slot, feed_row=r))
            logits = self._ready().execute(items, feed=prev)
            tokens, p = self._sample(logits, active)
            drawn.append(tokens)
            probs.append(p)
            prev = tokens
        for row in rows:
            row.seq.num_kv = row.req.num_tokens
        return drawn, probs

    def _sample(
        self, logits: torch.Tensor, rows: list[_Row]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One token per row: argmax for greedy rows, a draw from the transformed
        distribution for the others (whose probabilities come back, in row order)."""
        tokens = logits.argmax(dim=-1)
        idx = [r for r, row in enumerate(rows) if not row.req.params.greedy]
        if not idx:
            return tokens, None
        sub = logits
        index = None
        if len(idx) < len(rows):
            index = torch.tensor(idx, dtype=torch.long).to(logits.device, non_blocking=True)
            sub = logits.index_select(0, index)
        params = [rows[r].req.params for r in idx]
        probs = draft_probs(self._sampler, sub, params)
        gens = [rows[r].seq.generator for r in idx]
        picked = self._sampler.race(probs.clone(), gens)  # (race divides in place)
        if index is None:
            return picked, probs
        return tokens.index_copy(0, index, picked), probs
