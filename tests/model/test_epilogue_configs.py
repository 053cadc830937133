"""The epilogues' launch configs above rank 16 follow the pipelined-loop switch
(``LORAPLEX_EPILOGUE_STAGES``, lora_delta.wide_rank_stages); those at rank 16 and below never do."""

from __future__ import annotations

import pytest


def test_wide_rank_stages_switch(monkeypatch) -> None:
    """LORAPLEX_EPILOGUE_STAGES sets the pipelined loop in the configs of steps above rank 16
    only (Np: silu_mul's slices paired too); a bad value is refused."""
    from loraplex.engine.model.kernels import add_rmsnorm, lora_delta, qkv_rope, silu_mul

    def configs():
        return (
            silu_mul.silu_mul_config(32, 8, 64),
            qkv_rope.qkv_rope_config(32, 8, 64),
            qkv_rope.qkv_rope_config(64, 8, 64),
            add_rmsnorm.norm_config(32, 4096, 64),
        ), (
            silu_mul.silu_mul_config(32, 8, 16),
            qkv_rope.qkv_rope_config(32, 8, 16),
            add_rmsnorm.norm_config(32, 4096, 16),
        )

    try:
        for raw, want, paired in (("0", 0, False), ("3", 3, False), ("2p", 2, True)):
            monkeypatch.setenv("LORAPLEX_EPILOGUE_STAGES", raw)
            lora_delta.wide_rank_stages.cache_clear()
            wide, narrow = configs()
            assert [c.stages for c in wide] == [want] * len(wide)
            assert wide[0].paired is paired
            assert [c.stages for c in narrow] == [0] * len(narrow)
            assert not narrow[0].paired
        for bad in ("x", "0p", "5", "p"):
            monkeypatch.setenv("LORAPLEX_EPILOGUE_STAGES", bad)
            lora_delta.wide_rank_stages.cache_clear()
            with pytest.raises(ValueError, match="LORAPLEX_EPILOGUE_STAGES"):
                configs()
    finally:
        monkeypatch.delenv("LORAPLEX_EPILOGUE_STAGES")
        lora_delta.wide_rank_stages.cache_clear()
