"""Linear layers and the token embedding over raw ggml blocks (``GgmlBlockWeight``).

    GgmlLinear(w)(x [..., K]) -> [..., N]        y in x's dtype
    GgmlEmbedding(w, dtype)(ids [T]) -> [T, K]   gather the ids' block rows, dequantize only them

GgmlLinear runs the C++ ``ggml_matmul`` (fitserve.kernels.cpu.ggml_blocks) where it exists for
the weight's type and x is float32 / bfloat16, else the pure-torch path: dequantize bounded row
chunks (float32, exact to gguf-py) and F.linear, as ``run_torch`` does for packed weights.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fitserve.kernels.cpu.ggml_blocks import ggml_dequant_rows, ggml_kernel_available, ggml_matmul
from fitserve.ledger.scratch import output_staging_rows
from fitserve.quant.ggml_blocks import GgmlBlockWeight, dequantize_blocks

# the dtypes ggml_dequant_rows writes (one rounding from float32, as .to())
_KERNEL_ROW_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# Rows dequantized at once by the torch path: ~1M elements (4 MiB of fp32) whatever the layer.
_TORCH_CHUNK_ELEMENTS = 1 << 20


def kernel_available(ggml_type: str, dtype: torch.dtype) -> bool:
    """Whether ``ggml_matmul`` runs this type for activations of ``dtype``.

    NOTE: bf16 activations only, as PackedLinear's table (fitserve.model.linear): the kernel
    quantizes x to int8 the way llama.cpp does, which is the bf16 model's precision; a float32
    model is the exact mode and dequantizes (the torch path)."""
    if dtype != torch.bfloat16:
        return False
    try:
        return ggml_kernel_available(ggml_type)
    except Exception:  # a broken build counts as absent: the pure-torch path runs
        return False


def torch_matmul(x: torch.Tensor, blocks: torch.Tensor, ggml_type: str, n: int,
                 k: int) -> torch.Tensor:
    """``x [M, K] @ W.T`` in x's dtype, W dequantized in row chunks: the reference path."""
    rows = max(1, _TORCH_CHUNK_ELEMENTS // k)
    outs = [F.linear(x, dequantize_blocks(blocks[r0 : r0 + rows], ggml_type).to(x.dtype))
            for r0 in range(0, n, rows)]
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)


class GgmlLinear(nn.Module):
    """``y = x @ W.T (+ bias)`` with W held as its ggml blocks (buffer ``blocks``)."""

    blocks: torch.Tensor

    def __init__(self, w: GgmlBlockWeight, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.ggml_type, self.in_features, self.out_features = w.ggml_type, w.K, w.N
        self.register_buffer("blocks", w.blocks)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.force_torch = False  # tests and benchmarks: the pure-torch path whatever is built
        # NOTE: decided once (not per call): a compiled decode step traces only a bool here
        self._kernel = {dt: kernel_available(w.ggml_type, dt)
                        for dt in (torch.float32, torch.bfloat16)}

    @property
    def weight_blocks(self) -> GgmlBlockWeight:
        """The weight over this module's buffer (no copy)."""
        return GgmlBlockWeight(self.ggml_type, self.out_features, self.in_features, self.blocks)

    def uses_kernel(self, dtype: torch.dtype) -> bool:
        """Whether a call with x of ``dtype`` runs the C++ kernel."""
        return not self.force_torch and self._kernel.get(dtype, False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        n, k = self.out_features, self.in_features
        if self.uses_kernel(x2.dtype):
            y = self._kernel_rows(x2.contiguous())
        else:
            y = torch_matmul(x2, self.blocks, self.ggml_type, n, k)
        if self.bias is not None:
            y = y + self.bias
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], n)

    def _kernel_rows(self, x2: torch.Tensor) -> torch.Tensor:
        """The kernel's float32 rows cast into x's dtype, at most ``output_staging_rows``
        rows a call (the ledger's "output staging" line).

        NOTE: a prefill chunk's float32 [M, N] in one piece was 128 MiB at SmolLM2-1.7B's
        gate/up (M = 2,048), beside its bf16 copy; equal pieces of >= 2 rows keep every call on
        the M > 1 tiles, whose rows do not depend on M (the K-quants' M = 1 path is another)."""
        n, k, m = self.out_features, self.in_features, x2.shape[0]
        rows = output_staging_rows(n)
        if m <= rows:
            out: torch.Tensor = ggml_matmul(x2, self.blocks, self.ggml_type, n, k)
            return out.to(x2.dtype)
        pieces = -(-m // rows)
        step = -(-m // pieces)
        y = x2.new_empty(m, n)
        for r0 in range(0, m, step):
            y[r0 : r0 + step].copy_(ggml_matmul(x2[r0 : r0 + step], self.blocks,
                                                self.ggml_type, n, k))
        return y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"format={self.ggml_type}, bias={self.bias is not None}")


def runs_ggml_kernels(model: nn.Module, dtype: torch.dtype) -> bool:
    """Whether a GgmlLinear of ``model`` runs the C++ kernel for activations of ``dtype`` (the
    ledger's "output staging" line then counts its float32 rows)."""
    return any(type(m) is GgmlLinear and m.uses_kernel(dtype) for m in model.modules())


class GgmlEmbedding(nn.Module):
    """Token embedding held as ggml blocks: the rows of ``ids`` are gathered, then dequantized
    (exact to gguf-py) into ``dtype``. ``tied_linear()`` is the lm_head over the SAME buffer."""

    blocks: torch.Tensor

    def __init__(self, w: GgmlBlockWeight, dtype: torch.dtype) -> None:
        super().__init__()
        self.ggml_type, self.num_embeddings, self.embedding_dim = w.ggml_type, w.N, w.K
        self.dtype = dtype
        self.register_buffer("blocks", w.blocks)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if (self.blocks.device.type == "cpu" and self.dtype in _KERNEL_ROW_DTYPES
                and ggml_kernel_available(self.ggml_type)):
            # NOTE: one C++ call (the same bits): the torch ops below cost ~180 us a decode
            # step on a 1024-wide Q4_K embedding, a few us there
            return ggml_dequant_rows(self.blocks, ids, self.ggml_type, self.embedding_dim,
                                     self.dtype)
        rows = self.blocks.index_select(0, ids.reshape(-1))
        out = dequantize_blocks(rows, self.ggml_type).to(self.dtype)
        return out.reshape(*ids.shape, self.embedding_dim)

    def tied_linear(self) -> GgmlLinear:
        w = GgmlBlockWeight(self.ggml_type, self.num_embeddings, self.embedding_dim, self.blocks)
        return GgmlLinear(w)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, format={self.ggml_type}"
