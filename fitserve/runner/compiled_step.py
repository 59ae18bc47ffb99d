"""The decode-only forward under torch.compile (``--enforce-eager`` turns it off).

What is compiled: one step in which every sequence decodes one token on the CPU's fused paged
kernel (``CpuPagedDecode``), from the token ids to the final hidden states. The fitserve C++ ops
(packed linears, fused norms, RoPE + cache write, paged attention) stay opaque calls in the graph
(their fake kernels give inductor the shapes); inductor fuses the torch code between them and
runs the whole step without per-module Python. Prefill chunks and mixed steps run eager (their
shapes change every step; their cost is the matmuls, not the dispatch).

Shapes: the batch is dynamic within the packed linears' shape classes ("m1", "m<=16",
"m<=256": the kernel table is keyed by them, so each is its own graph); the block-table
width is dynamic and padded to >= 2 columns so that a short context is not specialized to 1.
The first call of a class runs eager (it binds each linear's kernel for that class); the next
one compiles. Inductor's caches live under ``$FITSERVE_HOME/compile``, so a second start of
the same model on the same machine loads the compiled code instead of building it.

Numerics: the compiled graph calls the same kernels; the torch code between them (embedding
dequantization, the final norm's add) may be fused by inductor in fp32, so bf16 outputs can
differ from eager in the last bit; fp32 greedy tokens are identical (tests/numerics).
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch

from fitserve.envs import fitserve_home
from fitserve.model.attention.backend import DecodeBatch
from fitserve.model.attention.cpu_paged import CPU_PAGED_DECODE, CpuPagedDecode
from fitserve.model.attention.paged import AttentionBatch
from fitserve.model.linear import shape_class
from fitserve.model.llama import CausalLM

log = logging.getLogger("fitserve.compile")

MIN_TABLE_WIDTH = 2  # dynamo specializes a dimension of size 1: pad the block tables past it


def compile_cache_dir() -> Path:
    return fitserve_home() / "compile"


def use_fitserve_compile_cache() -> None:
    """Point inductor's caches at ``$FITSERVE_HOME/compile`` unless the user chose a folder.

    NOTE: torch writes its default (/tmp/torchinductor_$USER) into TORCHINDUCTOR_CACHE_DIR the
    first time it asks, so a value equal to that default was not the user's choice; inductor
    reads the variable again on every cache lookup, so setting it before compiling suffices.
    """
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if current is None or current == default_cache_dir():
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(compile_cache_dir())


class CompiledDecode:
    """``applies(batch)`` says whether a step can run compiled; ``__call__`` runs it."""

    def __init__(self, model: CausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 window: int | None) -> None:
        use_fitserve_compile_cache()
        self.model, self.kv_caches, self.window = model, kv_caches, window
        self._fn = torch.compile(self._forward, dynamic=True, fullgraph=True)
        self._bound: set[str] = set()  # shape classes whose kernels an eager call has bound
        self.compile_seconds: dict[str, float] = {}  # shape class -> its first compiled call (s)
        self.compiled_calls = 0  # steps that ran the compiled graph (tests check it is used)

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor) -> torch.Tensor:
        decode = DecodeBatch(num=input_ids.shape[0], block_tables=block_tables,
                             backend=CPU_PAGED_DECODE, seq_lens=seq_lens, window=self.window)
        batch = AttentionBatch(slot_mapping=slot_mapping, decode=decode)
        hidden: torch.Tensor = self.model(input_ids, positions, batch, self.kv_caches)
        return hidden

    @staticmethod
    def applies(batch: AttentionBatch) -> bool:
        d = batch.decode
        return (not batch.prefills and d is not None and isinstance(d.backend, CpuPagedDecode)
                and d.num <= 256)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 batch: AttentionBatch) -> torch.Tensor:
        d = batch.decode
        assert d is not None and d.seq_lens is not None
        cls = shape_class(d.num)
        if cls not in self._bound:
            self._bound.add(cls)
            hidden: torch.Tensor = self.model(input_ids, positions, batch, self.kv_caches)
            return hidden
        tables = d.block_tables
        if tables.shape[1] < MIN_TABLE_WIDTH:
            tables = torch.nn.functional.pad(tables, (0, MIN_TABLE_WIDTH - tables.shape[1]))
        self.compiled_calls += 1
        first = cls not in self.compile_seconds
        t0 = time.perf_counter()
        out: torch.Tensor = self._fn(input_ids, positions, batch.slot_mapping, tables, d.seq_lens)
        if not first:
            return out
        self.compile_seconds[cls] = time.perf_counter() - t0
        log.info("compiled the decode step for batch class %r in %.1f s (cache: %s)", cls,
                 self.compile_seconds[cls], os.environ.get("TORCHINDUCTOR_CACHE_DIR"))
        return out
