"""An EAGLE-like draft head: predicts the target's next hidden state from its current one.

EAGLE drafts at the feature level: the target's last hidden state ``h_t`` (the one whose logits
gave token ``x_{t+1}``) and that token's embedding predict ``h_{t+1}``; the target's own
``lm_head`` turns the prediction into the distribution of ``x_{t+2}``, and the head runs again on
its own prediction for the next draft::

    h_t ----+                                 h'_{t+1} --+
            +-> [e(x_{t+1}) ; h_t] -> fc -> SiLU -> out -> (+ h_t) = h'_{t+1} -> lm_head -> x_{t+2}
    x_{t+1} +  (e = the target's embedding)              +-> with e(x_{t+2}): h'_{t+2} -> ...

NOTE: EAGLE's head also has one attention layer over earlier features (and so a KV cache of its
own); this one is a residual MLP only, which keeps the mechanism (features in, the target's
lm_head out, autoregression on predicted features) with no cache to manage. The weights are
the head's own: one file of four tensors (``fc.weight`` [I, 2H], ``fc.bias``, ``out.weight``
[H, I], ``out.bias``), trained on the target's own hidden states (see the tests).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

HEAD_TENSORS = ("fc.weight", "fc.bias", "out.weight", "out.bias")


class EagleHead(nn.Module):
    """``h' = h + out(SiLU(fc([e(x); h])))`` for a target of hidden size ``hidden_size``, with
    ``intermediate_size`` units in between (default 4 x hidden)."""

    def __init__(self, hidden_size: int, intermediate_size: int | None = None) -> None:
        super().__init__()
        inner = intermediate_size or 4 * hidden_size
        self.hidden_size = hidden_size
        self.fc = nn.Linear(2 * hidden_size, inner)
        self.out = nn.Linear(inner, hidden_size)
        nn.init.zeros_(self.out.weight)  # an untrained head predicts "the same feature again"
        nn.init.zeros_(self.out.bias)

    def forward(self, token_embedding: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        x = torch.cat((token_embedding, hidden), dim=-1)
        return hidden + self.out(torch.nn.functional.silu(self.fc(x)))

    def save(self, path: str | Path) -> None:
        from safetensors.torch import save_file

        save_file({k: v.detach().contiguous() for k, v in self.state_dict().items()}, str(path),
                  metadata={"format": "fitserve-eagle-head", "hidden_size": str(self.hidden_size)})


def load_eagle_head(path: str | Path, hidden_size: int, *, dtype: torch.dtype,
                    device: torch.device) -> EagleHead:
    """The head in ``path`` for a target of ``hidden_size``; ValueError naming what is wrong."""
    from safetensors import safe_open

    p = Path(path)
    if not p.is_file():
        raise ValueError(f"EAGLE head file {str(p)!r} does not exist")
    try:
        with safe_open(str(p), framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open has no iterator
    except Exception as exc:  # noqa: BLE001 - a corrupt file is the user's input
        raise ValueError(f"EAGLE head file {str(p)!r} is not a safetensors file: {exc}") from None
    missing = [k for k in HEAD_TENSORS if k not in tensors]
    if missing:
        raise ValueError(f"EAGLE head file {str(p)!r} lacks tensors {missing}")
    inner, width = tensors["fc.weight"].shape
    if width != 2 * hidden_size or tuple(tensors["out.weight"].shape) != (hidden_size, inner):
        raise ValueError(f"EAGLE head {str(p)!r} is for hidden size {width // 2}, the target has {hidden_size}")
    head = EagleHead(hidden_size, inner)
    head.load_state_dict({k: tensors[k] for k in HEAD_TENSORS})
    return head.to(device=device, dtype=dtype).eval()
