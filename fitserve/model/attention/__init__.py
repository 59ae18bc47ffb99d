"""Attention over the paged KV cache: the backend interface and its metadata (backend), the
backends (cpu_paged, gather, triton_attn), the rule that picks one per step (dispatch) and the
per-layer entry point (paged)."""
