"""LoRA compute on the model side: the slot-stacked layers and their per-step mapping, vocab and
full-table LoRA, rank buckets, DoRA's row scale, the slot image format and the device half of a
slot write (``slot_buffers``), and every LoRA kernel with its torch twin (``ops/``). Nothing here
imports the adapter lifecycle, the engine core or the entry points."""
