"""Convert a loaded tensor into the form the engine holds it in (dense dtype, fp8, or packed by
RTN), and the choices behind it.

The choice of format per tensor is the planner's rule (``fitserve.ledger.formats
.engine_tensor_format``), so the engine allocates what `fitserve plan` prints. Loaders call
``hold`` tensor by tensor, so at most one tensor's float copy exists at a time.
"""

from __future__ import annotations

import torch

from fitserve.ledger.formats import engine_tensor_format, tensor_role, weight_format
from fitserve.quant.fp8 import quantize_fp8
from fitserve.quant.held import HeldTensor, as_held, dtype_table_name, table_dtype
from fitserve.quant.rtn import quantize

# NOTE: a mixture-of-experts router (mlp.gate) and Qwen2-MoE's shared_expert_gate stay in the
# model dtype under every --weights choice, as llama.cpp's quantizer and vLLM keep them: their
# few rows pick the experts, and a rounding there changes which weights run.
_ROUTER_SUFFIXES = (".mlp.gate.weight", ".mlp.shared_expert_gate.weight")


def held_format(choice: str, hf_name: str, ndim: int, stored: str, dtype: torch.dtype) -> str:
    """The format the engine holds ``hf_name`` in under ``--weights choice``."""
    role = "vector" if hf_name.endswith(_ROUTER_SUFFIXES) else tensor_role(hf_name, ndim)
    return engine_tensor_format(choice, stored, role, dtype_table_name(dtype))


def hold(tensor: torch.Tensor, fmt: str) -> HeldTensor:
    """``tensor`` (float) in format ``fmt``: packed by RTN, fp8 with per-channel scales, or
    cast to that dense dtype."""
    f = weight_format(fmt)
    if f.gguf:
        raise ValueError(f"{fmt} is held only as a GGUF file's own blocks (as stored); float "
                         "weights are not re-quantized to it (--weights int4/int8 are)")
    if f.fp8:
        return quantize_fp8(tensor.float(), f.fp8, "channel")
    if f.packed is not None:
        return quantize(tensor, fmt)
    return tensor.to(table_dtype(f.name))


def held_bytes(t: HeldTensor) -> int:
    """Bytes a held tensor occupies."""
    return as_held(t).nbytes


def loaded_weights_choice(loaded_choice: str | None, wanted: str, *, explicit: bool,
                          dtype: torch.dtype) -> str:
    """The ``--weights`` choice an engine built on an already loaded model runs with.

    ``loaded_choice``: what ``load_model(..., weights=)`` was given (None: every tensor dense,
    which the engine casts to ``dtype``); ``wanted``: the engine config's resolved choice,
    ``explicit`` when the config asked for it (not "auto"). An auto config takes what was
    loaded; an explicit one must match it (ValueError otherwise).
    """
    have = loaded_choice if loaded_choice is not None else dtype_table_name(dtype)
    if have == wanted or not explicit:
        return have
    raise ValueError(f"the given LoadedModel holds its weights as {have!r}, the engine config "
                     f"asks for {wanted!r}: load it with load_model(..., weights={wanted!r})")
