"""A quantized paged KV cache: int8 or fp8 codes with float32 scales, one object per layer.

Codes are head-major like the dense cache, ``[Hkv, num_blocks, block_size, D]`` one byte each
(int8 as int8; fp8 as its bits in uint8: CPU torch has no index_copy for float8). Two scale
layouts (``fitserve.ledger.formats.KV_FORMATS`` prices both)::

    "token"        K and V: one scale per token per KV head    scales [Hkv, NB, bs]
                   (absmax over head_dim / qmax)
    "channel-key"  K: one scale per block per KV head per channel  scales [Hkv, NB, D]
                   (absmax over the block's tokens, per channel: KIVI's finding that keys
                   have outlier *channels* and values outlier *tokens*)
                   V: per token, as above

Per-channel key scales and blocks that fill one token at a time: a block's scale is the
running absmax of the tokens written so far. When a new token exceeds it, the scale grows and
the block's earlier codes are requantized to the new scale (decode with the old, encode with
the new). So the scale only grows, a block's tokens always share the scale they are read with,
and an earlier token's error is at most the final scale/2 plus its rounding at the scale it had
(<= 1 final scale in all, against scale/2 when a block is quantized once). A write at offset 0
starts a block afresh (a newly allocated block: freed blocks keep stale scales). Copy-on-write
copies codes and scales together.

``rope_write_`` does a step's rotation and write in one C++ call per layer (kvq_write.cpp), bit
for bit what RotaryEmbedding and ``write`` do in torch; the decode loops call it.

Readers dequantize only the blocks a step touches into a compact dense cache (``dequantize``),
which the runner's remapped block tables index, so every attention kernel runs unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from fitserve.kernels.cpu.paged_attention_kvq import CODEC_IDS, kvq_write_available

KEY_LAYOUTS = ("token", "channel-key")


@dataclass(frozen=True, slots=True)
class KVCodec:
    """An element format: ``encode(x / scale)`` -> one-byte codes, ``decode`` -> float32."""

    name: str  # "int8" | "fp8_e4m3" | "fp8_e5m2"
    qmax: float  # the largest code magnitude: absmax maps to it
    fp8: torch.dtype | None = None  # the float8 dtype the uint8 codes hold, None for int8

    @property
    def storage(self) -> torch.dtype:
        return torch.uint8 if self.fp8 is not None else torch.int8

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """float32 values already divided by their scale -> codes (round to nearest even)."""
        if self.fp8 is None:
            return torch.round(x).clamp_(-self.qmax, self.qmax).to(torch.int8)
        # NOTE: torch's cast to e5m2 overflows to inf past its max: clamp first (e4m3fn
        # saturates, but the clamp costs nothing and keeps the two alike)
        return x.clamp(-self.qmax, self.qmax).to(self.fp8).view(torch.uint8)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        if self.fp8 is None:
            return codes.to(torch.float32)
        return codes.view(self.fp8).to(torch.float32)


CODECS: dict[str, KVCodec] = {
    "int8": KVCodec("int8", 127.0),
    "fp8_e4m3": KVCodec("fp8_e4m3", 448.0, torch.float8_e4m3fn),
    "fp8_e5m2": KVCodec("fp8_e5m2", 57344.0, torch.float8_e5m2),
}


def _safe(scale: torch.Tensor) -> torch.Tensor:
    """The divisor for a scale: 1 where the scale is 0 (an all-zero group encodes to 0)."""
    return torch.where(scale > 0, scale, torch.ones_like(scale))


Zeros = Callable[[tuple[int, ...], torch.dtype, "torch.device | str"], torch.Tensor]
"""Allocates a zero-filled tensor (shape, dtype, device)."""


def _torch_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str
                 ) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype, device=device)


class QuantizedKVCache:
    """One layer's K and V in ``codec`` codes with ``key_layout`` key scales (see the module
    docstring); values are always per token."""

    def __init__(self, codec: str, key_layout: str, *, num_kv_heads: int, num_blocks: int,
                 block_size: int, head_dim: int, device: torch.device | str = "cpu",
                 zeros: Zeros = _torch_zeros) -> None:
        if codec not in CODECS:
            raise ValueError(f"unknown KV codec {codec!r}; known: {', '.join(CODECS)}")
        if key_layout not in KEY_LAYOUTS:
            raise ValueError(f"unknown key scale layout {key_layout!r}; known: "
                             f"{', '.join(KEY_LAYOUTS)}")
        self.codec = CODECS[codec]
        self.key_layout = key_layout
        self.block_size = block_size
        h, nb, bs, d = num_kv_heads, num_blocks, block_size, head_dim
        store = self.codec.storage
        # the runner passes fitserve.runner.lazy_memory.lazy_zeros: resident on the CPU only as
        # blocks are first written
        self.k_codes = zeros((h, nb, bs, d), store, device)
        self.v_codes = zeros((h, nb, bs, d), store, device)
        key_scale_shape = (h, nb, d) if key_layout == "channel-key" else (h, nb, bs)
        self.k_scales = zeros(key_scale_shape, torch.float32, device)
        self.v_scales = zeros((h, nb, bs), torch.float32, device)

    @property
    def nbytes(self) -> int:
        """Bytes held: codes and scales, K and V."""
        ts = (self.k_codes, self.v_codes, self.k_scales, self.v_scales)
        return sum(t.numel() * t.element_size() for t in ts)

    def write(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """Quantize new K/V ``[N, Hkv, D]`` into flat ``slots`` [N] (block * bs + offset)."""
        self._write_per_token(v, slots, self.v_codes, self.v_scales)
        if self.key_layout == "token":
            self._write_per_token(k, slots, self.k_codes, self.k_scales)
        else:
            self._write_channel_keys(k, slots)

    def rope_write_(self, qk: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                    cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor, num_q_heads: int,
                    interleaved: bool) -> bool:
        """Rotate qk [N, Hq + Hkv, D] in place by the fp32 tables' rows ``positions`` (in qk's
        dtype, as RotaryEmbedding does) and ``write`` its keys and v, in one C++ call. False
        (nothing done) where the op is not built or does not apply: the caller rotates and
        writes in torch."""
        if not (qk.device.type == "cpu" and self.k_codes.is_contiguous()
                and qk.stride(-1) == 1 and v.stride(-1) == 1 and cos.shape[-1] * 2 == qk.shape[-1]
                and self.codec.name in CODEC_IDS and kvq_write_available()):
            return False
        torch.ops.fitserve.rope_write_kvq_(
            qk, v, positions, cos, sin, self.k_codes, self.v_codes, self.k_scales, self.v_scales,
            slots, num_q_heads, interleaved, CODEC_IDS[self.codec.name],
            self.key_layout == "channel-key")
        return True

    def _write_per_token(self, x: torch.Tensor, slots: torch.Tensor, codes: torch.Tensor,
                         scales: torch.Tensor) -> None:
        xf = x.float()
        scale = xf.abs().amax(-1) / self.codec.qmax  # [N, H]
        q = self.codec.encode(xf / _safe(scale).unsqueeze(-1))
        h, _, _, d = codes.shape
        codes.view(h, -1, d).index_copy_(1, slots, q.transpose(0, 1))
        scales.view(h, -1).index_copy_(1, slots, scale.transpose(0, 1).contiguous())

    def _write_channel_keys(self, k: torch.Tensor, slots: torch.Tensor) -> None:
        kf = k.float()
        blocks = torch.div(slots, self.block_size, rounding_mode="floor")
        fresh_slot = slots % self.block_size == 0
        touched, inv = torch.unique(blocks, return_inverse=True)  # [U], [N]
        u = touched.numel()
        n, h, d = kf.shape
        new_max = torch.zeros(u, h * d, dtype=torch.float32, device=k.device).scatter_reduce_(
            0, inv[:, None].expand(n, h * d), kf.abs().reshape(n, h * d), "amax").view(u, h, d)
        fresh = torch.zeros(u, dtype=torch.bool, device=k.device)
        fresh[inv[fresh_slot]] = True
        old = self.k_scales.index_select(1, touched).transpose(0, 1)  # [U, H, D]
        old = torch.where(fresh[:, None, None], torch.zeros_like(old), old)
        new = torch.maximum(old, new_max / self.codec.qmax)
        grew = ~fresh & (new > old).flatten(1).any(-1)
        if bool(grew.any()):
            self._requantize(touched[grew], old[grew], new[grew])
        self.k_scales.index_copy_(1, touched, new.transpose(0, 1).contiguous())
        q = self.codec.encode(kf / _safe(new)[inv])
        self.k_codes.view(h, -1, d).index_copy_(1, slots, q.transpose(0, 1))

    def _requantize(self, blocks: torch.Tensor, old: torch.Tensor, new: torch.Tensor) -> None:
        """Re-encode the codes of ``blocks`` written under per-channel scales ``old`` [C, H, D]
        at the grown scales ``new`` (codes under a 0 scale are 0 and stay 0)."""
        codes = self.k_codes.index_select(1, blocks)  # [H, C, bs, D]
        values = self.codec.decode(codes) * old.transpose(0, 1).unsqueeze(2)
        requant = self.codec.encode(values / _safe(new).transpose(0, 1).unsqueeze(2))
        self.k_codes.index_copy_(1, blocks, requant)

    def dequantize(self, block_ids: torch.Tensor, dtype: torch.dtype
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """Dense K and V ``[Hkv, len(block_ids), bs, D]`` in ``dtype`` for those blocks."""
        kc = self.codec.decode(self.k_codes.index_select(1, block_ids))
        ks = self.k_scales.index_select(1, block_ids)
        k = kc * (ks.unsqueeze(2) if self.key_layout == "channel-key" else ks.unsqueeze(-1))
        vc = self.codec.decode(self.v_codes.index_select(1, block_ids))
        v = vc * self.v_scales.index_select(1, block_ids).unsqueeze(-1)
        return k.to(dtype), v.to(dtype)

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy-on-write: codes and scales of blocks ``src`` into ``dst`` (block axis 1)."""
        for t in (self.k_codes, self.v_codes, self.k_scales, self.v_scales):
            t.index_copy_(1, dst, t.index_select(1, src))
