"""Exact activation patching: many cells per forward pass, equal to ``transformer_lens.patching``.

:mod:`.patching` is the entry point; :mod:`.engine` (our models) and :mod:`.kv_patching`
(TransformerLens bridges) recompute only what a patch changes.
"""
