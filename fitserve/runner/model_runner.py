"""SchedulerOutput -> tensors -> forward -> sampled tokens.

The runner owns the per-layer KV cache tensors ([num_kv_heads, num_blocks, block_size, head_dim]
each; one tensor per layer so a compiled step never rewrites a stacked cache) and turns the
scheduler's block tables into the flat cache slots each new token writes::

    slot(p) = block_table[p // block_size] * block_size + p % block_size
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from fitserve import envs
from fitserve.config import ModelSpec
from fitserve.kernels.cpu.paged_attention import paged_attention_available
from fitserve.kernels.cpu.paged_attention_kvq import paged_attention_kvq_available
from fitserve.kv.group import KVGroup
from fitserve.ledger.formats import kv_format as kv_format_entry
from fitserve.ledger.formats import resolve_engine_kv_format
from fitserve.ledger.sampler_memory import sampler_chunk_rows
from fitserve.model.attention.backend import AttentionBackend, DecodeBatch, PrefillSeq
from fitserve.model.attention.dispatch import choose_attention_backend, classify
from fitserve.model.attention.paged import AttentionBatch
from fitserve.model.llama import CausalLM, LayerKV
from fitserve.model.moe import SparseMoeBlock
from fitserve.quant.kv_cache import QuantizedKVCache
from fitserve.runner.compiled_step import CompiledDecode
from fitserve.runner.decode_loop import DecodeLoop
from fitserve.runner.lazy_memory import lazy_zeros
from fitserve.runner.prompt_logprobs import compute_prompt_logprobs, prompt_spans
from fitserve.runner.rope_rows import rope_rows
from fitserve.sampling import RequestSamplingState, Sampler
from fitserve.types import RunnerOutput, ScheduledChunk, SchedulerOutput, SpecDecodeInputs

DraftVerifier = Callable[[torch.Tensor, list[int], torch.Tensor | None, RequestSamplingState,
                          Sampler], list[int]]
"""Rejection sampling of one chunk's drafts: (target logits [k + 1, V], draft tokens, draft probs
or None, the request's sampling state, the sampler) -> the tokens it emits."""


class ModelRunner:
    """Runs one scheduler step on the model and samples the chunks that end a request's tokens."""

    def __init__(
        self,
        model: CausalLM,
        spec: ModelSpec,
        *,
        num_blocks: int,
        block_size: int,
        kv_dtype: torch.dtype,
        device: torch.device,
        compile_decode: bool = False,
        kv_cache_dtype: str = "auto",
        kv_cache_scales: str = "auto",
        verify: DraftVerifier | None = None,
        kv_groups: Sequence[KVGroup] = (),
        prompt_logprob_chunk_rows: int | None = None,
    ) -> None:
        self.model = model
        # prompt positions scored at once (fitserve.ledger.sampler_memory.prompt_logprob_chunk_rows)
        self.prompt_logprob_chunk_rows = (prompt_logprob_chunk_rows if prompt_logprob_chunk_rows
                                          else sampler_chunk_rows(spec.vocab_size))
        # speculative decoding's rejection sampling (fitserve.spec_decode.rejection.verify), given
        # by the engine's builder when speculation is on; None: a chunk with drafts is an error
        self.verify_drafts = verify
        self.spec = spec
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.device = device
        self.sliding_window = spec.sliding_window
        # a hybrid model (several KV layer groups): each layer's group, each group's window
        self.layer_group: list[int] | None = None
        self.group_windows: list[int | None] = []
        layer_blocks = [num_blocks] * spec.num_layers
        if len(kv_groups) > 1:
            self.layer_group = [0] * spec.num_layers
            for g, group in enumerate(kv_groups):
                for layer in group.layers:
                    self.layer_group[layer] = g
                    layer_blocks[layer] = group.num_blocks
            if sorted(la for g in kv_groups for la in g.layers) != list(range(spec.num_layers)):
                raise ValueError(f"the KV groups' layers {[g.layers for g in kv_groups]} do not cover "
                                 f"the model's {spec.num_layers} layers once each")
            self.group_windows = [g.window for g in kv_groups]
        # soft-capped attention (Gemma 2) dispatches to a backend that applies the cap
        self.softcap = spec.attn_logit_softcapping is not None
        # attention sinks (gpt-oss) likewise: a backend that adds them to the softmax
        self.sinks = any(getattr(getattr(layer, "self_attn", None), "sinks", None) is not None
                         for layer in getattr(model, "layers", ()))
        # LongRoPE: the long factors' rows of the rotary table start here (None: one table)
        self.long_row_offset: int | None = getattr(model.rotary, "long_row_offset", None)
        self.kv_format = resolve_engine_kv_format(kv_cache_dtype, kv_cache_scales, _table_name(kv_dtype))
        self.kv_caches = make_kv_caches(spec, self.kv_format, num_blocks=num_blocks, block_size=block_size,
                                        dtype=kv_dtype, device=device, layer_blocks=layer_blocks)
        # a quantized cache: each step dequantizes the blocks it reads into a compact dense cache
        self.quantized_kv = isinstance(self.kv_caches[0], QuantizedKVCache)
        self.sampler = Sampler()
        self.use_triton = device.type == "cuda" and _triton_importable()
        # the fused C++ decode kernel (built at first use; FITSERVE_DISABLE_CPP=1 turns it off)
        self.use_cpp = device.type == "cpu" and paged_attention_available()
        # a quantized cache read in place by the quantized decode kernel in decode-only steps
        self.use_kvq = self.quantized_kv and device.type == "cpu" and paged_attention_kvq_available()
        # decode-only steps under torch.compile (fitserve.runner.compiled_step); None = eager
        self.compiled: CompiledDecode | None = None
        # NOTE: a hybrid model's steps run through the modules (one batch per layer group); the
        # compiled step and the flat decode loop bind one batch for every layer
        one_batch = self.layer_group is None
        if compile_decode and self.use_cpp and not self.quantized_kv and one_batch:
            self.compiled = CompiledDecode(model, self.kv_caches, spec.sliding_window)
        for module in model.modules():  # the experts stacked before the first request
            if isinstance(module, SparseMoeBlock):
                module.prepare_grouped()
        # eager decode-only steps as one flat loop of prebound ops (fitserve.runner.decode_loop);
        # FITSERVE_DECODE_LOOP=0 runs them through the modules instead (same bits, slower)
        self.decode_loop: DecodeLoop | None = None
        if (one_batch and self.use_cpp and (self.use_kvq or not self.quantized_kv)
                and envs.FITSERVE_DECODE_LOOP() and DecodeLoop.supports(model, kv_dtype)):
            self.decode_loop = DecodeLoop(model, kv_dtype)

    def _backend(self, q_lens: list[int], k_lens: list[int], kv_quant: bool = False
                 ) -> AttentionBackend:
        return choose_attention_backend(
            classify(self.device.type, q_lens, k_lens, triton=self.use_triton, cpp=self.use_cpp,
                     kv_quant=kv_quant, softcap=self.softcap, sinks=self.sinks)
        )

    @property
    def kv_cache_bytes(self) -> int:
        return sum(layer_kv_bytes(kv) for kv in self.kv_caches)

    @torch.inference_mode()
    def forward_chunks(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        """Hidden states [tokens, hidden] of ``chunks`` (decode-like chunks first, see
        ``decode_rows_first``), written into and read from the cache; nothing sampled."""
        return self._forward(*self._prepare(chunks))

    @torch.inference_mode()
    def execute(
        self, out: SchedulerOutput, states: dict[str, RequestSamplingState]
    ) -> RunnerOutput:
        if out.group_block_copies:
            for g, pairs in enumerate(out.group_block_copies):
                if pairs:
                    self.copy_blocks(pairs, group=g)
        elif out.block_copies:
            self.copy_blocks(out.block_copies)
        chunks = decode_rows_first(out.chunks)
        input_ids, positions, batch = self._prepare(chunks, self._long_prompts(states))
        hidden = self._forward(input_ids, positions, batch)
        sample_rows, sample_ids, verify = logits_rows(chunks)
        result = RunnerOutput(sampled={})
        spans = prompt_spans(chunks, states)
        if spans:  # before the sampled rows' logits exist (the ledger's sampling phase)
            result.prompt_logprobs = compute_prompt_logprobs(
                self.model.compute_logits, hidden, spans, self.prompt_logprob_chunk_rows)
        spec = out.spec_decode
        if sample_rows:
            logits = self.model.compute_logits(self._rows(hidden, sample_rows))
            tokens, logprobs = self.sampler(logits, [states[r] for r in sample_ids])
            result.sampled.update(zip(sample_ids, tokens, strict=True))
            if spec is not None and spec.return_hidden_states:
                result.hidden_states.update(
                    (rid, hidden[row].clone()) for rid, row in zip(sample_ids, sample_rows, strict=True))
            for rid, lp in zip(sample_ids, logprobs, strict=True):
                if lp is not None:
                    result.logprobs[rid] = lp
        if verify:
            self._verify(hidden, verify, states, spec or SpecDecodeInputs(), result)
        return result

    def _long_prompts(self, states: dict[str, RequestSamplingState]) -> set[str]:
        """LongRoPE: the requests whose prompt is longer than the original context (all their
        tokens take the long factors, fitserve.runner.rope_rows)."""
        rs = self.spec.rope_scaling
        if self.long_row_offset is None or rs is None:
            return set()
        orig = rs.original_max_position_embeddings
        return {rid for rid, st in states.items() if len(st.prompt_token_ids) > orig}

    def _rows(self, hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """``hidden[rows]``; ``hidden`` itself when that is every row in order (a decode-only
        step samples each of its rows: no index tensor, no copy)."""
        if len(rows) == hidden.shape[0] and rows == list(range(len(rows))):
            return hidden
        return hidden[torch.tensor(rows, device=self.device)]

    def _verify(self, hidden: torch.Tensor, verify: list[tuple[ScheduledChunk, int]],
                states: dict[str, RequestSamplingState], spec: SpecDecodeInputs,
                result: RunnerOutput) -> None:
        """Speculative decoding: score each chunk's k drafts and one more position in the one
        forward that ran, and keep what rejection sampling accepts (fitserve.spec_decode)
        against ``spec.draft_probs`` (absent: point masses)."""
        rows = [r for chunk, last in verify for r in range(last - chunk.num_draft, last + 1)]
        logits = self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)]).float()
        if self.verify_drafts is None:
            raise RuntimeError("a chunk with draft tokens, but this runner verifies none "
                               "(speculative decoding is off)")
        at = 0
        for chunk, _ in verify:
            k = chunk.num_draft
            rid = chunk.request_id
            drafts = chunk.token_ids[-k:]
            emitted = self.verify_drafts(logits[at: at + k + 1], drafts, spec.draft_probs.get(rid),
                                    states[rid], self.sampler)
            if spec.return_hidden_states:  # the row that gave the last emitted token
                result.hidden_states[rid] = hidden[rows[at + len(emitted) - 1]].clone()
            at += k + 1
            result.emitted[rid] = emitted
            result.sampled[rid] = emitted[-1]

    def copy_blocks(self, copies: list[tuple[int, int]], group: int | None = None) -> None:
        """Copy-on-write: the K/V of each (src, dst) block pair, every layer (``group``: the
        layers of that KV layer group), before the step's writes. No dst is another pair's src
        (dst blocks are fresh, src blocks still held), so the pairs are copied at once."""
        src = torch.tensor([s for s, _ in copies], dtype=torch.long, device=self.device)
        dst = torch.tensor([d for _, d in copies], dtype=torch.long, device=self.device)
        for i, kv in enumerate(self.kv_caches):
            if group is not None and self.layer_group is not None and self.layer_group[i] != group:
                continue
            if isinstance(kv, QuantizedKVCache):
                kv.copy_blocks(src, dst)
                continue
            for t in kv:  # [kv_heads, num_blocks, block_size, head_dim]
                t.index_copy_(1, dst, t.index_select(1, src))

    @torch.inference_mode()
    def warm_up_compiled(self, batch_sizes: list[int]) -> dict[str, float]:
        """Compile the decode step for the shape classes of ``batch_sizes`` now (dummy steps
        that write slot 0 of block 0 and attend one key: the pool holds no request yet), so
        the first requests do not wait on the compiler. Returns seconds per class."""
        if self.compiled is None:
            return {}
        for n in batch_sizes:
            for _ in range(2):  # the first call of a class binds kernels, the second compiles
                chunks = [ScheduledChunk(request_id=f"warm-up-{i}", token_ids=[0], start_pos=0,
                                         block_table=[0], sample=False) for i in range(n)]
                self._forward(*self._prepare(chunks))
        return dict(self.compiled.compile_seconds)

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 batch: AttentionBatch) -> torch.Tensor:
        """The model's forward (compiled for decode-only steps when enabled), with oneDNN on or
        off for this step's token count."""
        onednn_before = torch.backends.mkldnn.enabled
        torch.backends.mkldnn.enabled = self._use_onednn(len(input_ids))  # type: ignore[assignment]
        try:
            if self.compiled is not None and self.compiled.applies(batch):
                return self.compiled(input_ids, positions, batch)
            if self.decode_loop is not None and self.decode_loop.applies(batch, self.kv_caches,
                                                                          len(input_ids)):
                return self.decode_loop(input_ids, positions, batch, self.kv_caches)
            hidden: torch.Tensor = self.model(input_ids, positions, batch, self.kv_caches)
            return hidden
        finally:
            torch.backends.mkldnn.enabled = onednn_before

    def _use_onednn(self, num_tokens: int) -> bool:
        # NOTE: measured on AVX512-BF16 CPUs: oneDNN's bf16 matmul is several times slower than
        # torch's own kernel for a single row (batch-1 decode) and several times faster from a
        # few rows up. fp32 is indifferent.
        return not (self.device.type == "cpu" and num_tokens <= 1)

    def _prepare(
        self, chunks: list[ScheduledChunk], long_prompt_ids: set[str] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionBatch]:
        long = long_prompt_ids or set()
        if self.layer_group is None:
            return self._prepare_group(chunks, [c.block_table for c in chunks],
                                       self.sliding_window, long)
        # a hybrid model: one batch per KV layer group (its tables and window), each layer
        # reads its group's (AttentionBatch.per_layer)
        groups = [self._prepare_group(chunks, [c.group_tables[g] for c in chunks], w, long)
                  for g, w in enumerate(self.group_windows)]
        ids, pos, first = groups[0]
        batch = AttentionBatch(slot_mapping=first.slot_mapping, decode=first.decode,
                               prefills=first.prefills, kv_blocks=first.kv_blocks,
                               per_layer=[groups[g][2] for g in self.layer_group])
        return ids, pos, batch

    def _prepare_group(
        self, chunks: list[ScheduledChunk], tables: list[list[int]], window: int | None,
        long_prompt_ids: set[str],
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionBatch]:
        """Token ids, rotary rows (positions, or LongRoPE's rows) and the attention batch of
        ``chunks`` over ``tables`` (one per chunk, in a KV layer group whose layers see
        ``window`` keys)."""
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefills: list[PrefillSeq] = []
        # a quantized cache: decode-only steps read it in place (the quantized kernel; not under
        # soft-capping, which only EagerGather applies); others dequantize the blocks they read
        # into a compact dense cache the tables then index
        in_place = (self.use_kvq and not self.softcap and not self.sinks
                    and all(runs_as_decode(c) for c in chunks))
        compact = (compact_blocks(chunks, bs, tables) if self.quantized_kv and not in_place
                   else None)
        cap = self.spec.attn_logit_softcapping
        for chunk, table in zip(chunks, tables, strict=True):
            start, t = chunk.start_pos, len(chunk.token_ids)
            ids.extend(chunk.token_ids)
            rng = range(start, start + t)
            pos.extend(rope_rows(chunk, self.spec, self.long_row_offset, long_prompt_ids))
            slots.extend(table[p // bs] * bs + p % bs for p in rng)
            if compact is not None:  # attention reads the compact cache: its block indices
                table = [compact[b] for b in table[: -(-(start + t) // bs)]]
            if runs_as_decode(chunk):
                # NOTE: a verification chunk [last, d1 .. dk] is k + 1 decode rows over one
                # table, row i seeing keys < start + i + 1: every token's K/V is written before
                # attention reads, so this is its causal attention, on the fused decode kernel.
                decode_tables.extend([table] * t)
                decode_lens.extend(range(start + 1, start + t + 1))
            else:
                seq = self._backend([t], [start + t]).build_prefill(
                    len(ids) - t, start, t, table, block_size=bs, window=window,
                    device=self.device,
                )
                seq.softcap = cap
                prefills.append(seq)
        decode = (self._decode_batch(decode_tables, decode_lens, window, in_place)
                  if decode_tables else None)
        if decode is not None:
            decode.softcap = cap
        batch = AttentionBatch(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=self.device),
            decode=decode,
            prefills=prefills,
            kv_blocks=None if compact is None else torch.tensor(list(compact), dtype=torch.long,
                                                                device=self.device),
        )
        dev = self.device
        return (
            torch.tensor(ids, dtype=torch.long, device=dev),
            torch.tensor(pos, dtype=torch.long, device=dev),
            batch,
        )

    def _decode_batch(self, tables: list[list[int]], seq_lens: list[int], window: int | None,
                      kv_quant: bool = False) -> DecodeBatch:
        return self._backend([1] * len(tables), seq_lens, kv_quant).build_decode(
            tables, seq_lens, block_size=self.block_size, window=window,
            device=self.device,
        )


def _table_name(dtype: torch.dtype) -> str:
    return {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}[dtype]


def make_kv_caches(spec: ModelSpec, kv_format: str, *, num_blocks: int, block_size: int,
                   dtype: torch.dtype, device: torch.device,
                   layer_blocks: Sequence[int] | None = None) -> list[LayerKV]:
    """One cache per layer in ``kv_format`` (a KV_FORMATS name): dense (K, V) tensors of
    ``dtype`` [kv_heads, num_blocks, block_size, head_dim] (head-major), or a QuantizedKVCache.
    ``layer_blocks``: each layer's own block count (a hybrid model's layer groups have pools of
    their own). Zero-filled; on the CPU resident only as blocks are first written
    (``lazy_zeros``)."""
    fmt = kv_format_entry(kv_format)
    blocks = list(layer_blocks) if layer_blocks is not None else [num_blocks] * spec.num_layers
    if fmt.codec:
        key_layout = "channel-key" if fmt.key_scales == "channel" else "token"
        return [QuantizedKVCache(fmt.codec, key_layout, num_kv_heads=spec.num_kv_heads,
                                 num_blocks=n, block_size=block_size,
                                 head_dim=spec.head_dim, device=device, zeros=lazy_zeros)
                for n in blocks]
    return [(lazy_zeros((spec.num_kv_heads, n, block_size, spec.head_dim), dtype, device),
             lazy_zeros((spec.num_kv_heads, n, block_size, spec.head_dim), dtype, device))
            for n in blocks]


def layer_kv_bytes(kv: LayerKV) -> int:
    """Bytes one layer's cache holds (codes and scales for a quantized one)."""
    if isinstance(kv, QuantizedKVCache):
        return kv.nbytes
    return sum(t.numel() * t.element_size() for t in kv)


def compact_blocks(chunks: list[ScheduledChunk], block_size: int,
                   tables: list[list[int]] | None = None) -> dict[int, int]:
    """Physical block -> its index in the step's compact cache: the blocks the step reads
    (each chunk's table, or its ``tables`` entry, up to its last new token), in first-seen
    order."""
    out: dict[int, int] = {}
    for i, c in enumerate(chunks):
        table = c.block_table if tables is None else tables[i]
        for b in table[: -(-(c.start_pos + len(c.token_ids)) // block_size)]:
            out.setdefault(b, len(out))
    return out


def logits_rows(chunks: list[ScheduledChunk]
                ) -> tuple[list[int], list[str], list[tuple[ScheduledChunk, int]]]:
    """The packed rows whose logits a step needs: (sampling rows, the request id sampling each,
    (chunk with drafts, its last row) to verify). n>1 children sample from their parent's row."""
    sample_rows: list[int] = []
    sample_ids: list[str] = []
    verify: list[tuple[ScheduledChunk, int]] = []
    offset = 0
    for chunk in chunks:
        offset += len(chunk.token_ids)
        if chunk.num_draft:
            verify.append((chunk, offset - 1))
        elif chunk.sample:
            for rid in (chunk.request_id, *chunk.fanout):
                sample_rows.append(offset - 1)
                sample_ids.append(rid)
    return sample_rows, sample_ids, verify


def runs_as_decode(chunk: ScheduledChunk) -> bool:
    """One new token, or a speculative verification chunk (a few tokens at the cache's end)."""
    return len(chunk.token_ids) == 1 or chunk.num_draft > 0


def decode_rows_first(chunks: list[ScheduledChunk]) -> list[ScheduledChunk]:
    """Decode-like chunks first: they form one contiguous, batched slice of the packed tokens."""
    return sorted(chunks, key=lambda c: not runs_as_decode(c))


def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
