"""The eager decode step as one flat loop of prebound op calls (the CPU fast path at batch 1).

A decode step of SmolLM2 makes ~30 calls per layer through nn.Module.__call__, the fused-op
wrappers' checks and PackedLinear's lookup; at batch 1 that Python is a quarter of the step.
``DecodeLoop`` walks the same layers calling the same ops in the same order, with every
per-layer tensor and chosen kernel looked up once per shape class (1 / <= 16 / <= 256 / more):

    embed -> per layer: add_rms_norm_ -> qkv -> rope_write_kv_ -> paged_decode_attention
             -> o_proj -> add_rms_norm_ -> gate_up -> silu_and_mul -> down -> final norm

so its hidden states are bit-identical to ``CausalLM.forward`` (tests/numerics/
test_decode_loop.py). It applies to decode-only steps on the fused C++ kernels (``applies``), with
a dense KV cache or a quantized one read in place (int8 / fp8 codes: rope_write_ then
paged_decode_attention_kvq instead of rope_write_kv_ then paged_decode_attention, the module
path's calls); anything else (prefill chunks, per-head q/k norms, the torch fallbacks) runs the
module path. A linear it does not know exactly (a tensor-parallel
wrapper, a ConcatLinear, fp8, a biased packed one) is called as its module: never skipped.

When every linear of the step's shape class is a C++ packed kernel or a dense nn.Linear, the
per-layer loop itself runs in C++ (``torch.ops.fitserve_step.decode_layers``,
fitserve/kernels/cpu/decode_step.cpp): the same ops, in the same order, without the ~270
interpreter round trips of a batch-1 step. Its per-model arguments (weights, norms, caches)
are a plan made once per shape class (``decode_plan``, an integer handle). ``native = False``
(or FITSERVE_DECODE_NATIVE=0) keeps the Python loop.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from fitserve import envs
from fitserve.kernels.cpu.decode_step import decode_step_available
from fitserve.kernels.cpu.fused import fused_ops_available
from fitserve.kernels.cpu.paged_attention import DEFAULT_PARTITION, paged_attention_available
from fitserve.kernels.cpu.paged_attention_kvq import (
    CODEC_IDS,
    kvq_write_available,
    paged_attention_kvq_available,
)
from fitserve.model.attention.cpu_paged import CpuPagedDecode
from fitserve.model.attention.paged import AttentionBatch
from fitserve.model.layers import GatedMLP, RMSNorm
from fitserve.model.linear import DenseLinear, PackedLinear, shape_class
from fitserve.model.llama import CausalLM, LayerKV
from fitserve.quant.kv_cache import QuantizedKVCache

Linear = Callable[[torch.Tensor], torch.Tensor]
# input norm weight, eps, qkv, o_proj, post-attention norm weight, eps, gate_up, down
BoundLayer = tuple[torch.Tensor, float, Linear, Linear, torch.Tensor, float, Linear, Linear]
# decode_plan's per-model lists of a shape class: norms, eps, linear tensors, linear meta
NativeArgs = tuple[list[torch.Tensor], list[float], list[torch.Tensor], list[int]]
_DENSE, _INT4, _INT8, _BF16_GEMV = 0, 1, 2, 3  # decode_step.cpp's LinearKind
_PACKED_KINDS = {4: _INT4, 8: _INT8}  # by the packed codes' bits


def linear_call(mod: nn.Module, rows: int, dtype: torch.dtype) -> Linear:
    """``mod`` as a call on x [rows, K]: the chosen kernel bound to its weight where the module
    is exactly a bias-free PackedLinear or an nn.Linear, else the module itself."""
    if type(mod) is PackedLinear and mod.bias is None:
        return mod.bound_run(rows, dtype)
    if type(mod) in (nn.Linear, DenseLinear):
        w, b = mod.weight, mod.bias
        if type(mod) is DenseLinear and mod.gemv_applies(rows, dtype):
            gemv = torch.ops.fitserve_dense.bf16_gemv.default
            return lambda x: gemv(x, w, b)
        return lambda x: F.linear(x, w, b)
    return mod


def native_linear(mod: nn.Module, rows: int, dtype: torch.dtype
                  ) -> tuple[list[torch.Tensor], list[int]] | None:
    """``mod`` as decode_step.cpp's 3 tensors + (kind, group, act_quant, has_third), when the
    C++ loop makes exactly the call ``linear_call`` would; None when it cannot."""
    none = torch.empty(0)
    if type(mod) is PackedLinear and mod.bias is None:
        kernel = mod.kernel(rows, dtype).name
        if kernel not in ("cpp", "cpp-aq") or mod.k_padded != mod.in_features:
            return None  # bind() wraps these in Python (another kernel, or x needs padding)
        # act_quant: 1 int8 activations, 0 weight-only, 2 weight-only in one order for every M
        # (an explicit --activation-quant none: PackedLinear binds batch_invariant the same way)
        aq = 1 if kernel == "cpp-aq" else (2 if mod.act_quant is not None else 0)
        has_mins = mod.mins is not None  # asymmetric int4 only
        return ([mod.qweight, mod.scales, mod.mins if has_mins else none],
                [_PACKED_KINDS[mod.codes.bits], mod.group_size, aq, int(has_mins)])
    if type(mod) in (nn.Linear, DenseLinear):
        has_bias = mod.bias is not None
        kind = _BF16_GEMV if type(mod) is DenseLinear and mod.gemv_applies(rows, dtype) else _DENSE
        return [mod.weight, none, mod.bias if has_bias else none], [kind, 0, 0, int(has_bias)]
    return None


def quantized_loop_available() -> bool:
    """The quantized cache's fused writer and decode kernel are both built."""
    return kvq_write_available() and paged_attention_kvq_available()


def _plan_caches(kv_caches: list[LayerKV]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """decode_plan's K and V caches: the dense tensors, or a quantized cache's codes."""
    if isinstance(kv_caches[0], QuantizedKVCache):
        return ([kv.k_codes for kv in kv_caches],  # type: ignore[union-attr]
                [kv.v_codes for kv in kv_caches])  # type: ignore[union-attr]
    return [kv[0] for kv in kv_caches], [kv[1] for kv in kv_caches]  # type: ignore[index]


def _plan_codec(kv_caches: list[LayerKV]) -> dict[str, object]:
    """decode_plan's quantized-cache arguments (scales, codec id, key layout; none for dense)."""
    first = kv_caches[0]
    if not isinstance(first, QuantizedKVCache):
        return {"k_scales": [], "v_scales": [], "kv_codec": -1, "channel_keys": False}
    return {"k_scales": [kv.k_scales for kv in kv_caches],  # type: ignore[union-attr]
            "v_scales": [kv.v_scales for kv in kv_caches],  # type: ignore[union-attr]
            "kv_codec": CODEC_IDS[first.codec.name],
            "channel_keys": first.key_layout == "channel-key"}


def _norm_ok(norm: nn.Module, dtype: torch.dtype) -> bool:
    return type(norm) is RMSNorm and norm.weight.dtype == dtype


def _drop_plans(handles: list[int]) -> None:
    """Release decode_plan handles (the weights and caches they hold) and forget them."""
    try:
        for h in handles:
            torch.ops.fitserve_step.drop_decode_plan(h)
    except (AttributeError, RuntimeError):  # interpreter shutdown: the op may be gone already
        pass
    handles.clear()


class DecodeLoop:
    """``applies(batch, kv_caches)`` says whether a step can run here; ``__call__`` runs it."""

    def __init__(self, model: CausalLM, dtype: torch.dtype) -> None:
        self.model, self.dtype = model, dtype
        self._layers: dict[str, list[BoundLayer]] = {}  # shape class -> bound layers
        # shape class -> decode_plan handle (None: a linear decode_layers cannot run), for the
        # kv_caches list _plans_kv; every live handle is in _handles, dropped with the loop
        self._plans: dict[str, int | None] = {}
        self._plans_kv: list[LayerKV] | None = None
        self._handles: list[int] = []
        weakref.finalize(self, _drop_plans, self._handles)
        self.native = envs.FITSERVE_DECODE_NATIVE()
        self.calls = 0  # steps run here (tests check the fast path is the one taken)
        self.native_calls = 0  # of which through decode_layers

    @staticmethod
    def supports(model: nn.Module, dtype: torch.dtype) -> bool:
        """The model is the plain CPU decoder this loop replays (no TP wrapper, no q/k norms,
        dense MLPs: an expert block's routing is not one prebound op list)."""
        if type(model) is not CausalLM or not (fused_ops_available() and paged_attention_available()):
            return False
        if not model.layers or not _norm_ok(model.norm, dtype):
            return False
        return all(layer.self_attn.q_norm is None and isinstance(layer.mlp, GatedMLP)
                   and _norm_ok(layer.input_layernorm, dtype)
                   and _norm_ok(layer.post_attention_layernorm, dtype) for layer in model.layers)

    def applies(self, batch: AttentionBatch, kv_caches: list[LayerKV], num_tokens: int) -> bool:
        d = batch.decode
        if (batch.prefills or d is None or d.num != num_tokens
                or not isinstance(d.backend, CpuPagedDecode) or d.seq_lens is None):
            return False
        if isinstance(kv_caches[0], tuple):
            return not d.backend.reads_quantized_kv
        # a quantized cache: the step reads it in place and the fused writer is built
        return (d.backend.reads_quantized_kv and quantized_loop_available()
                and all(isinstance(kv, QuantizedKVCache) and kv.k_codes.is_contiguous()
                        and kv.codec.name in CODEC_IDS for kv in kv_caches))

    def _bound(self, rows: int) -> list[BoundLayer]:
        key = shape_class(rows)
        layers = self._layers.get(key)
        if layers is None:
            layers = self._layers[key] = []
            for layer in self.model.layers:
                att, mlp = layer.self_attn, layer.mlp
                layers.append((
                    layer.input_layernorm.weight, layer.input_layernorm.eps,
                    linear_call(att.qkv_proj, rows, self.dtype),
                    linear_call(att.o_proj, rows, self.dtype),
                    layer.post_attention_layernorm.weight, layer.post_attention_layernorm.eps,
                    linear_call(mlp.gate_up_proj, rows, self.dtype),
                    linear_call(mlp.down_proj, rows, self.dtype),
                ))
        return layers

    def _native_args(self, rows: int) -> NativeArgs | None:
        """decode_plan's per-model lists for ``rows``: norms, eps, linear tensors and meta."""
        norms: list[torch.Tensor] = []
        eps: list[float] = []
        tensors: list[torch.Tensor] = []
        meta: list[int] = []
        for layer in self.model.layers:
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norms.append(norm.weight)
                eps.append(float(norm.eps))
            att, mlp = layer.self_attn, layer.mlp
            for mod in (att.qkv_proj, att.o_proj, mlp.gate_up_proj, mlp.down_proj):
                spec = native_linear(mod, rows, self.dtype)
                if spec is None:
                    return None
                tensors += spec[0]
                meta += spec[1]
        return norms, eps, tensors, meta

    def _plan(self, rows: int, kv_caches: list[LayerKV]) -> int | None:
        """The decode_plan handle of ``rows``' shape class over ``kv_caches`` (made on first use;
        all are made again for another cache list), or None where decode_layers cannot run."""
        if self._plans_kv is not kv_caches:
            _drop_plans(self._handles)
            self._plans.clear()
            self._plans_kv = kv_caches
        key = shape_class(rows)
        if key not in self._plans:
            args = self._native_args(rows)
            handle = None
            if args is not None:
                first = self.model.layers[0].self_attn
                rotary = self.model.rotary
                handle = torch.ops.fitserve_step.decode_plan(
                    *args, *_plan_caches(kv_caches), first.num_heads, first.num_kv,
                    first.head_dim, first.scale, DEFAULT_PARTITION, rotary.interleaved,
                    **_plan_codec(kv_caches))
                self._handles.append(handle)
            self._plans[key] = handle
        return self._plans[key]

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch,
                 kv_caches: list[LayerKV]) -> torch.Tensor:
        """input_ids, positions [N] -> final hidden states [N, hidden], as CausalLM.forward."""
        m = self.model
        d = batch.decode
        assert d is not None and d.seq_lens is not None
        n = input_ids.shape[0]
        cos, sin = m.rotary.cos, m.rotary.sin
        slots, tables, lens = batch.slot_mapping, d.block_tables, d.seq_lens
        window = 0 if d.window is None else int(d.window)
        x = m.embed_tokens(input_ids)
        plan = self._plan(n, kv_caches) if self.native and decode_step_available() else None
        if plan is not None:
            residual, x = torch.ops.fitserve_step.decode_layers.default(
                x, positions, cos, sin, slots, tables, lens, plan, window)
            self.calls += 1
            self.native_calls += 1
            return m.norm.add_forward(residual, x)

        first = m.layers[0].self_attn
        hq, hkv, hd = first.num_heads, first.num_kv, first.head_dim
        qk_cols, q_size, scale = first.q_size + first.kv_size, first.q_size, first.scale
        interleaved = m.rotary.interleaved
        rms_norm = torch.ops.fitserve_fused.rms_norm.default
        add_rms_norm_ = torch.ops.fitserve_fused.add_rms_norm_.default
        rope_write_kv_ = torch.ops.fitserve_fused.rope_write_kv_.default
        silu_and_mul = torch.ops.fitserve_fused.silu_and_mul.default
        attention = torch.ops.fitserve.paged_decode_attention.default
        attention_kvq = (torch.ops.fitserve.paged_decode_attention_kvq.default
                         if isinstance(kv_caches[0], QuantizedKVCache) else None)
        residual: torch.Tensor | None = None
        for (w_in, eps_in, qkv_proj, o_proj, w_post, eps_post, gate_up, down), kv in zip(
                self._bound(n), kv_caches, strict=True):
            if residual is None:
                residual, h = x, rms_norm(x, w_in, eps_in)
            else:
                h = add_rms_norm_(residual, x, w_in, eps_in)
            qkv = qkv_proj(h)
            qk = qkv[:, :qk_cols].view(n, hq + hkv, hd)
            v = qkv[:, qk_cols:].view(n, hkv, hd)
            if isinstance(kv, QuantizedKVCache):  # the module path's calls (llama.Attention)
                if not kv.rope_write_(qk, v, positions, cos, sin, slots, hq, interleaved):
                    raise RuntimeError("the fused quantized-cache writer did not apply")
                assert attention_kvq is not None
                out = attention_kvq(qk[:, :hq], kv.k_codes, kv.v_codes, kv.k_scales, kv.v_scales,
                                    tables, lens, scale, window, CODEC_IDS[kv.codec.name],
                                    kv.key_layout == "channel-key", DEFAULT_PARTITION, True)
            else:
                k_cache, v_cache = kv
                rope_write_kv_(qk, v, positions, cos, sin, k_cache, v_cache, slots, hq,
                               interleaved)
                out = attention(qk[:, :hq], k_cache, v_cache, tables, lens, scale, window,
                                DEFAULT_PARTITION, True)
            h = add_rms_norm_(residual, o_proj(out.reshape(n, q_size)), w_post, eps_post)
            x = down(silu_and_mul(gate_up(h)))
        self.calls += 1
        assert residual is not None
        return m.norm.add_forward(residual, x)
