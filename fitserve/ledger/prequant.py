"""The engine format that holds each pre-quantized checkpoint scheme (compressed-tensors,
GPTQ, AWQ): the one rule the loader (``fitserve.quant.hf_checkpoint_formats``) and the planner
(``fitserve.loading.hf_quant_config``) apply, so the plan counts what the engine holds."""

from __future__ import annotations

from dataclasses import dataclass

from fitserve.ledger.formats import PERM_SUFFIX


@dataclass(frozen=True, slots=True)
class QuantScheme:
    """One quantized weight's layout as its checkpoint stores it."""

    method: str  # "compressed-tensors" | "gptq" | "awq"
    bits: int  # 4 | 8
    group_size: int  # input columns per scale; 0 = one scale per output channel
    symmetric: bool
    act_order: bool = False  # gptq desc_act: g_idx assigns columns to groups out of order
    zero_offset: int = 0  # gptq v1 stores each zero point minus 1: add this back

    @property
    def tag(self) -> str:
        """Short words for reports: ``gptq int4 g128 sym act-order``."""
        group = f"g{self.group_size}" if self.group_size else "per-channel"
        return " ".join([self.method, f"int{self.bits}", group,
                         "sym" if self.symmetric else "asym",
                         *(["act-order"] if self.act_order else [])])


def held_format(scheme: QuantScheme, k: int, dense: str) -> str:
    """The engine format a weight of ``k`` input columns stored as ``scheme`` is held in;
    ``dense`` (the model dtype's table name) where the engine has no such layout.

    The group is the checkpoint's, or ``k`` rounded up to 32 per output channel (the engine's
    groups are multiples of 32 and whole groups pad a row, ``fitserve.quant.packed``).
    """
    group = scheme.group_size or -(-k // 32) * 32
    perm = PERM_SUFFIX if scheme.act_order and scheme.group_size else ""
    if group % 32:
        return dense
    if scheme.bits == 4:
        return f"int4-g{group}-{'sym' if scheme.symmetric else 'asym'}{perm}"
    if not scheme.symmetric:
        return dense  # NOTE: int8 codes with a zero point: no engine layout (int8 has no mins)
    return "int8-ch" if not scheme.group_size else f"int8-g{group}{perm}"
