"""The eager decode step as one flat loop of prebound op calls (the CPU fast path at batch 1).

A decode step of SmolLM2 makes ~30 calls per layer through nn.Module.__call__, the fused-op
wrappers' checks and PackedLinear's lookup; at batch 1 that Python is a quarter of the step.
``DecodeLoop`` walks the same layers calling the same ops in the same order, with every
per-layer tensor and chosen kernel looked up once per shape class (1 / <= 16 / <= 256 / more):

    embed -> per layer: add_rms_norm_ -> qkv -> rope_write_kv_ -> paged_decode_attention
             -> o_proj -> add_rms_norm_ -> gate_up -> silu_and_mul -> down -> final norm

so its hidden states are bit-identical to ``CausalLM.forward`` (tests/numerics/
test_decode_loop.py, test_decode_loop_moe.py). q/k norms (Qwen3's per head, OLMoE's over the
projection) run ``Attention.norm_qk`` after qkv, and a sparse MoE layer (Qwen3-MoE, Mixtral,
OLMoE, Qwen2-MoE) runs its ``SparseMoeBlock`` in place of gate_up -> down. It applies to
decode-only steps on the fused C++ kernels (``applies``), with a dense KV cache or a quantized
one read in place (int8 / fp8 codes: rope_write_ then paged_decode_attention_kvq instead of
rope_write_kv_ then paged_decode_attention, the module path's calls); anything else (prefill
chunks, the torch fallbacks, gpt-oss) runs the module path. A linear it does not know exactly (a tensor-parallel
wrapper, a ConcatLinear, fp8, a biased packed one) is called as its module: never skipped.

When every linear of the step's shape class is a C++ kernel (packed int4/int8, ggml blocks, fp8,
each with its bias as the module adds it) or a dense nn.Linear, or a ConcatLinear of those, the
per-layer loop itself runs in C++ (``torch.ops.fitserve_step.decode_layers``,
fitserve/kernels/cpu/decode_step.cpp): the same ops, in the same order, without the ~270
interpreter round trips of a batch-1 step. Its per-model arguments (weights, norms, caches)
are a plan made once per shape class (``decode_plan``, an integer handle), plus q/k norms and
MoE blocks (``decode_plan_layers``, decode_moe.h). A MoE layer runs natively only with its
experts on the grouped ggml kernel (bf16, GGUF K-/legacy-quant experts: GroupedExperts);
other experts (dense, packed, fp8) keep the Python loop, which calls the block as its module. ``native = False``
(or FITSERVE_DECODE_NATIVE=0) keeps the Python loop.
"""

from __future__ import annotations

import sys
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
from fitserve.model.fp8_linear import Fp8Linear
from fitserve.model.ggml_linear import GgmlLinear
from fitserve.model.layers import GatedMLP, RMSNorm
from fitserve.model.linear import ConcatLinear, DenseLinear, PackedLinear, shape_class
from fitserve.model.llama import Attention, CausalLM, DecoderLayer, LayerKV
from fitserve.model.moe import SparseMoeBlock
from fitserve.model.moe_experts import grouped_experts
from fitserve.quant.kv_cache import QuantizedKVCache

Linear = Callable[[torch.Tensor], torch.Tensor]
QkNorm = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # Attention.norm_qk(qkv, qk)
# input norm weight, eps, qkv, o_proj, post-attention norm weight, eps, gate_up, down, q/k norm
# (None: none), MoE block (None: the dense gate_up -> down; else gate_up / down are None)
BoundLayer = tuple[torch.Tensor, float, Linear, Linear, torch.Tensor, float, Linear | None,
                   Linear | None, QkNorm | None, Linear | None]
# decode_plan's per-model lists of a shape class: norms, eps, linear tensors, linear meta
NativeArgs = tuple[list[torch.Tensor], list[float], list[torch.Tensor], list[int]]
# decode_plan_layers' arguments (decode_moe.h): qk_norm mode, q/k norms, eps, MoE ints per layer,
# expert stacks, their ggml types, router / shared-expert linear tensors and meta
LayerArgs = tuple[int, list[torch.Tensor], list[float], list[int], list[torch.Tensor], list[str],
                  list[torch.Tensor], list[int]]
_QK_NONE, _QK_HEADS, _QK_WHOLE = 0, 1, 2  # decode_moe.h's QkNorm
# NOTE: a MoE layer has no dense gate_up / down: decode_plan's linear list (4 per layer) gets
# this module's spec in their slots, never called (decode_layers runs the MoE block there)
_PLACEHOLDER = nn.Linear(1, 1, bias=False)
# one linear in decode_plan's flat lists (decode_step.cpp's layout): its tensors, its meta ints
NativeLinear = tuple[list[torch.Tensor], list[int]]
_DENSE, _INT4, _INT8, _BF16_GEMV, _GGML, _FP8 = range(6)  # decode_step.cpp's LinearKind
_PACKED_KINDS = {4: _INT4, 8: _INT8}  # by the packed codes' bits
# the most rows of x in a shape class (fp8's op runs up to FP8_GEMV_MAX_ROWS rows)
_CLASS_ROWS = {"m1": 1, "m<=16": 16, "m<=256": 256, "prefill": sys.maxsize}


def _fp8_kernel_runs(mod: Fp8Linear, rows: int, dtype: torch.dtype) -> bool:
    """Whether every row count of ``rows``' shape class runs Fp8Linear's C++ op."""
    return mod.kernel_runs(_CLASS_ROWS[shape_class(rows)], dtype, mod.weight_fp8.device)


def _plus_bias(run: Linear, bias: torch.Tensor | None) -> Linear:
    """``run`` followed by the module's ``y + bias`` (PackedLinear, GgmlLinear)."""
    return run if bias is None else (lambda x: run(x) + bias)


def linear_call(mod: nn.Module, rows: int, dtype: torch.dtype) -> Linear:
    """``mod`` as a call on x [rows, K]: the kernel its forward picks for ``rows``' shape class
    and ``dtype``, bound to its tensors, where the module is one this loop knows exactly (a
    ConcatLinear: its parts' calls, concatenated); else the module itself."""
    if type(mod) is ConcatLinear:
        calls = [linear_call(part, rows, dtype) for part in mod.parts]
        return lambda x: torch.cat([call(x) for call in calls], dim=-1)
    if type(mod) is PackedLinear:
        return _plus_bias(mod.bound_run(rows, dtype), mod.bias)
    if type(mod) is GgmlLinear and mod.uses_kernel(dtype):
        ggml = torch.ops.fitserve.ggml_matmul.default
        blocks, qtype, n, k = mod.blocks.contiguous(), mod.ggml_type, mod.out_features, mod.in_features
        return _plus_bias(lambda x: ggml(x.contiguous(), blocks, qtype, n, k).to(x.dtype), mod.bias)
    if type(mod) is Fp8Linear and _fp8_kernel_runs(mod, rows, dtype):
        fp8 = torch.ops.fitserve_fp8.fp8_linear.default
        codes, scales, fb = mod.weight_fp8, mod.weight_scale, mod.bias
        fmt, gran, block = mod.fmt, mod.granularity, mod.block
        return lambda x: fp8(x, codes, scales, fmt, gran, block, fb)
    if type(mod) in (nn.Linear, DenseLinear):
        w, b = mod.weight, mod.bias
        if type(mod) is DenseLinear and mod.gemv_applies(rows, dtype):
            gemv = torch.ops.fitserve_dense.bf16_gemv.default
            return lambda x: gemv(x, w, b)
        return lambda x: F.linear(x, w, b)
    return mod


def _text(s: str) -> list[int]:
    """A string in decode_step.cpp's meta: its length, then one int per byte."""
    data = s.encode()
    return [len(data), *data]


def _part(kind: int, w: torch.Tensor, scales: torch.Tensor | None = None,
          mins: torch.Tensor | None = None, bias: torch.Tensor | None = None, i0: int = 0,
          i1: int = 0, s0: str = "", s1: str = "") -> NativeLinear:
    """One part of a linear in decode_step.cpp's layout (absent tensors as empty ones)."""
    none = torch.empty(0)
    tensors = [w, none if scales is None else scales, none if mins is None else mins,
               none if bias is None else bias]
    return tensors, [kind, i0, i1, int(mins is not None), int(bias is not None),
                     *_text(s0), *_text(s1)]


def native_part(mod: nn.Module, rows: int, dtype: torch.dtype) -> NativeLinear | None:
    """``mod`` (not a ConcatLinear) as one part of decode_step.cpp's layout, when the C++ loop
    makes exactly the calls ``linear_call`` makes; None when it cannot (a torch fallback)."""
    if type(mod) is PackedLinear:
        kernel = mod.kernel(rows, dtype).name
        if kernel not in ("cpp", "cpp-aq") or mod.k_padded != mod.in_features:
            return None  # bind() wraps these in Python (another kernel, or x needs padding)
        # act_quant: 1 int8 activations, 0 weight-only, 2 weight-only in one order for every M
        # (an explicit --activation-quant none: PackedLinear binds batch_invariant the same way)
        aq = 1 if kernel == "cpp-aq" else (2 if mod.act_quant is not None else 0)
        return _part(_PACKED_KINDS[mod.codes.bits], mod.qweight, mod.scales, mod.mins, mod.bias,
                     mod.group_size, aq)
    if type(mod) is GgmlLinear and mod.uses_kernel(dtype):
        return _part(_GGML, mod.blocks.contiguous(), bias=mod.bias, s0=mod.ggml_type)
    if type(mod) is Fp8Linear and _fp8_kernel_runs(mod, rows, dtype):
        return _part(_FP8, mod.weight_fp8, mod.weight_scale, bias=mod.bias, i0=mod.block,
                     s0=mod.fmt, s1=mod.granularity)
    if type(mod) in (nn.Linear, DenseLinear):
        kind = _BF16_GEMV if type(mod) is DenseLinear and mod.gemv_applies(rows, dtype) else _DENSE
        return _part(kind, mod.weight, bias=mod.bias)
    return None


def native_linear(mod: nn.Module, rows: int, dtype: torch.dtype) -> NativeLinear | None:
    """``mod`` in decode_step.cpp's layout: meta [parts, part...] and each part's 4 tensors (a
    ConcatLinear: one part per module, outputs concatenated); None when a part cannot run there."""
    parts = list(mod.parts) if type(mod) is ConcatLinear else [mod]
    tensors: list[torch.Tensor] = []
    meta = [len(parts)]
    for part in parts:
        spec = native_part(part, rows, dtype)
        if spec is None:
            return None
        tensors += spec[0]
        meta += spec[1]
    return tensors, meta


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
        self._kvq_checked: tuple[list[LayerKV], bool] | None = None  # applies' cache check
        weakref.finalize(self, _drop_plans, self._handles)
        self.native = envs.FITSERVE_DECODE_NATIVE()
        self.calls = 0  # steps run here (tests check the fast path is the one taken)
        self.native_calls = 0  # of which through decode_layers

    @staticmethod
    def supports(model: nn.Module, dtype: torch.dtype) -> bool:
        """The model is the plain CPU decoder this loop replays: no TP wrapper, Llama-family
        layers (not gpt-oss's), each MLP dense or a plain SparseMoeBlock (called as its module
        by the Python loop; natively where its experts are grouped, ``_moe_args``)."""
        if type(model) is not CausalLM or not (fused_ops_available() and paged_attention_available()):
            return False
        if not model.layers or not _norm_ok(model.norm, dtype):
            return False
        return all(type(layer) is DecoderLayer and type(layer.self_attn) is Attention
                   and layer.self_attn.sinks is None
                   and (isinstance(layer.mlp, GatedMLP) or type(layer.mlp) is SparseMoeBlock)
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
        # NOTE: the per-layer check once per cache list (it was ~5 us of every step)
        if self._kvq_checked is None or self._kvq_checked[0] is not kv_caches:
            self._kvq_checked = (kv_caches, quantized_loop_available() and all(
                isinstance(kv, QuantizedKVCache) and kv.k_codes.is_contiguous()
                and kv.codec.name in CODEC_IDS for kv in kv_caches))
        return d.backend.reads_quantized_kv and self._kvq_checked[1]

    def _bound(self, rows: int) -> list[BoundLayer]:
        key = shape_class(rows)
        layers = self._layers.get(key)
        if layers is None:
            layers = self._layers[key] = []
            for layer in self.model.layers:
                att, mlp = layer.self_attn, layer.mlp
                dense = isinstance(mlp, GatedMLP)
                layers.append((
                    layer.input_layernorm.weight, layer.input_layernorm.eps,
                    linear_call(att.qkv_proj, rows, self.dtype),
                    linear_call(att.o_proj, rows, self.dtype),
                    layer.post_attention_layernorm.weight, layer.post_attention_layernorm.eps,
                    linear_call(mlp.gate_up_proj, rows, self.dtype) if dense else None,
                    linear_call(mlp.down_proj, rows, self.dtype) if dense else None,
                    att.norm_qk if att.q_norm is not None else None,
                    None if dense else mlp,
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
            mlps = ((mlp.gate_up_proj, mlp.down_proj) if isinstance(mlp, GatedMLP)
                    else (_PLACEHOLDER, _PLACEHOLDER))
            for mod in (att.qkv_proj, att.o_proj, *mlps):
                spec = native_linear(mod, rows, self.dtype)
                if spec is None:
                    return None
                tensors += spec[0]
                meta += spec[1]
        return norms, eps, tensors, meta

    def _layer_args(self, rows: int) -> LayerArgs | None:
        """decode_plan_layers' arguments for ``rows`` (q/k norms, MoE blocks); None where
        decode_layers cannot run them (the plan then gets them only when some are set)."""
        layers = self.model.layers
        first = layers[0].self_attn
        mode = (_QK_NONE if first.q_norm is None
                else _QK_WHOLE if first.norm_whole else _QK_HEADS)
        qk_norms: list[torch.Tensor] = []
        qk_eps: list[float] = []
        for layer in layers:
            att = layer.self_attn
            if (att.q_norm is None) != (mode == _QK_NONE) or att.norm_whole != first.norm_whole:
                return None
            for norm in (att.q_norm, att.k_norm) if mode != _QK_NONE else ():
                # the whole-projection norm runs fused.rms_norm's C++ op only at x's dtype
                if type(norm) is not RMSNorm or (mode == _QK_WHOLE and not _norm_ok(norm, self.dtype)):
                    return None
                qk_norms.append(norm.weight)
                qk_eps.append(float(norm.eps))
        moe = self._moe_args(rows)
        return None if moe is None else (mode, qk_norms, qk_eps, *moe)

    def _moe_args(self, rows: int) -> tuple[list[int], list[torch.Tensor], list[str],
                                             list[torch.Tensor], list[int]] | None:
        """decode_plan_layers' MoE part: per layer (is_moe, top_k, renormalize, has_shared),
        each MoE layer's expert stacks + types and router (+ shared expert: gate_up, down, gate)
        linears; all empty for a dense model; None where a block's experts are not grouped."""
        ints: list[int] = []
        stacks: list[torch.Tensor] = []
        types: list[str] = []
        tensors: list[torch.Tensor] = []
        meta: list[int] = []
        probe = torch.empty(0, dtype=self.dtype)
        for layer in self.model.layers:
            mlp = layer.mlp
            if isinstance(mlp, GatedMLP):
                ints += [0, 0, 0, 0]
                continue
            if not mlp.allow_grouped:
                return None
            mlp._grouped = grouped = grouped_experts(mlp.experts, mlp._grouped)
            if not grouped.applies(probe, mlp.experts[0]):
                return None  # experts not on the grouped kernel: the module's per-expert loop
            linears = [mlp.gate]
            shared = mlp.shared_expert
            if shared is not None:
                if type(shared) is not GatedMLP or mlp.shared_expert_gate is None:
                    return None
                linears += [shared.gate_up_proj, shared.down_proj, mlp.shared_expert_gate]
            for mod in linears:
                spec = native_linear(mod, rows, self.dtype)
                if spec is None:
                    return None
                tensors += spec[0]
                meta += spec[1]
            ints += [1, mlp.top_k, int(mlp.renormalize), int(shared is not None)]
            stacks += [grouped.gate_up, grouped.down]
            types += [grouped.gate_up_type, grouped.down_type]
        if not stacks:
            ints = []
        return ints, stacks, types, tensors, meta

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
            layer_args = self._layer_args(rows)
            handle = None
            if args is not None and layer_args is not None:
                first = self.model.layers[0].self_attn
                rotary = self.model.rotary
                handle = torch.ops.fitserve_step.decode_plan(
                    *args, *_plan_caches(kv_caches), first.num_heads, first.num_kv,
                    first.head_dim, first.scale, DEFAULT_PARTITION, rotary.interleaved,
                    **_plan_codec(kv_caches))
                self._handles.append(handle)
                if layer_args[0] != _QK_NONE or layer_args[3]:
                    torch.ops.fitserve_step.decode_plan_layers(handle, *layer_args)
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
        for (w_in, eps_in, qkv_proj, o_proj, w_post, eps_post, gate_up, down, norm_qk, moe), kv in zip(
                self._bound(n), kv_caches, strict=True):
            if residual is None:
                residual, h = x, rms_norm(x, w_in, eps_in)
            else:
                h = add_rms_norm_(residual, x, w_in, eps_in)
            qkv = qkv_proj(h)
            qk = qkv[:, :qk_cols].view(n, hq + hkv, hd)
            v = qkv[:, qk_cols:].view(n, hkv, hd)
            if norm_qk is not None:
                qk = norm_qk(qkv, qk)
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
            if moe is not None:
                x = moe(h)
            else:
                assert gate_up is not None and down is not None
                x = down(silu_and_mul(gate_up(h)))
        self.calls += 1
        assert residual is not None
        return m.norm.add_forward(residual, x)
