"""Start-up of the draft-model proposer (``speculative_method`` "draft"): load the draft beside
the target and split one KV budget between the two caches.

Order (startup.py): the target loads, then the draft's weights (``load_draft``, the KV cache
left for later), then the free memory sizes both caches at once (``split_kv_budget``: every
target block comes with a draft block, so the target's cache is net of the draft's), then the
draft's cache is made (``DraftProposer.allocate``). Refusals are typed and name the config
field: a folder that is not a model, or whose vocabulary differs from the target's
(``DraftModelMismatchError``, ``speculative_model``), a draft adapter that does not load
(``speculative_draft_adapters``).
"""

from __future__ import annotations

from pathlib import Path

from loraplex.engine.config import EngineConfig
from loraplex.engine.errors import LoRAError, SpeculativeConfigError
from loraplex.engine.model.errors import ModelConfigError
from loraplex.engine.model.protocol import CausalLM
from loraplex.engine.model.tp import full_config
from loraplex.engine.spec.draft import DraftProposer, draft_kv_blocks, draft_kv_bytes_per_block
from loraplex.engine.spec.draft_check import DraftModelMismatchError
from loraplex.engine.tokenizer import Tokenizer

__all__ = ["draft_blocks_for", "load_draft", "split_kv_budget"]


def load_draft(
    config: EngineConfig, target: CausalLM, tokenizer: Tokenizer | None
) -> DraftProposer:
    """The draft of ``config.speculative_model`` on the target's device and dtype, checked
    against the target's config and ``tokenizer``, its adapters in its slots; no KV cache yet."""
    assert config.speculative_model is not None  # (EngineConfig refuses "draft" without one)
    folder = Path(config.speculative_model).expanduser()
    if not (folder / "config.json").is_file():
        raise SpeculativeConfigError(
            f"speculative_model (--speculative-model): {str(folder)!r} is not a model folder "
            "(no config.json)",
            field="speculative_model",
        )
    try:
        return DraftProposer(
            folder,
            num_blocks=None,
            target_config=full_config(target),
            target_tokenizer=tokenizer,
            device=target.device,
            dtype=target.dtype,
            block_size=config.block_size,
            adapters=config.draft_adapters,
            max_lora_rank=config.max_lora_rank,
            kernel_backend=config.kernel_backend,
            cuda_graphs=config.cuda_graphs,
            max_batched_tokens=config.max_num_batched_tokens,
            seed=config.seed,
        )
    except DraftModelMismatchError:
        raise  # (typed, names speculative_model)
    except ModelConfigError as e:
        raise SpeculativeConfigError(
            f"speculative_model (--speculative-model) {str(folder)!r}: {e}",
            field="speculative_model",
        ) from e
    except LoRAError as e:
        raise SpeculativeConfigError(
            f"speculative_draft_adapters (--speculative-draft-adapter): {e}",
            field="speculative_draft_adapters",
        ) from e


def draft_blocks_for(config: EngineConfig, num_blocks: int) -> int:
    """The draft's KV blocks beside a target cache of ``num_blocks`` blocks."""
    return draft_kv_blocks(
        num_blocks * config.block_size,
        config.block_size,
        config.max_num_seqs,
        config.num_speculative_tokens,
    )


def split_kv_budget(
    config: EngineConfig, budget: int, per_block: int, draft: DraftProposer
) -> tuple[int, int]:
    """(target blocks, draft blocks) within ``budget`` bytes of KV cache: n target blocks of
    ``per_block`` bytes need ``draft_blocks_for(n)`` draft blocks (one per target block plus a
    few per request), so n = (budget - the per-request part) // (per_block + draft block)."""
    per_draft = draft_kv_bytes_per_block(draft.config, draft.model.dtype, config.block_size)
    fixed = draft_blocks_for(config, 0) * per_draft
    n = max(budget - fixed, 0) // (per_block + per_draft)
    return n, draft_blocks_for(config, n)
