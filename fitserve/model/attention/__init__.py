"""Attention over the paged KV cache: the backend the runner picks once per step (dispatch) and
the paged implementations it runs (paged)."""
