"""KV-cache bytes per token, per block and per request, per tensor-parallel rank.

Per layer and token, one rank stores:

    full / sliding attention (GQA):  2 (K and V) x h_r x (head_dim x e + s)
    MLA latent (DeepSeek):           1 x ((kv_lora_rank + qk_rope_head_dim) x e + s)

where e = bytes per element of the KV format, s = its per-token-per-head scale bytes, and
h_r = ceil(num_kv_heads / tp) (a per-channel-key format has no per-token K scale: its K
scales are per block, ``kv_block_scale_bytes``, and a block is block_size tokens plus those);
h_r = ceil(num_kv_heads / tp): KV heads divide across ranks until tp exceeds the KV-head count;
past it every rank still holds one whole head, so each head is stored tp / num_kv_heads times.
The MLA latent is shared by all heads and cannot be split by head: every rank holds all of it.
"""

from __future__ import annotations

from dataclasses import dataclass

from fitserve.config import ModelSpec
from fitserve.ledger.errors import PlanError
from fitserve.ledger.formats import kv_format
from fitserve.ledger.params import is_mla


def check_tp(spec: ModelSpec, tp: int) -> None:
    """Raise PlanError unless ``tp`` splits the attention heads (and KV heads) evenly."""
    if tp < 1:
        raise PlanError(f"tensor parallel size must be >= 1, got {tp}")
    if spec.num_heads % tp:
        raise PlanError(f"--tp {tp} does not divide the {spec.num_heads} attention heads of "
                        f"{spec.name or spec.architecture}; use a divisor of {spec.num_heads}")
    kv = spec.num_kv_heads
    if not is_mla(spec) and kv % tp and tp % kv:
        raise PlanError(f"--tp {tp} neither divides nor is a multiple of the {kv} KV heads")


def kv_heads_per_rank(spec: ModelSpec, tp: int = 1) -> int:
    """KV heads one rank stores: ceil(num_kv_heads / tp) (1 head = the MLA latent)."""
    check_tp(spec, tp)
    return 1 if is_mla(spec) else -(-spec.num_kv_heads // tp)


def kv_replication(spec: ModelSpec, tp: int = 1) -> float:
    """How many copies of each KV head the TP group stores (1.0 = no duplication)."""
    if is_mla(spec):
        return float(tp)
    return tp * kv_heads_per_rank(spec, tp) / spec.num_kv_heads


def kv_layer_bytes_per_token(spec: ModelSpec, kv_dtype: str, *, tp: int = 1) -> int:
    """Bytes one rank stores per token for ONE layer (K and V, or the MLA latent)."""
    f = kv_format(kv_dtype)
    if is_mla(spec):
        width = spec.kv_lora_rank + spec.qk_rope_head_dim
        check_tp(spec, tp)
        return width * f.element_bytes + f.scale_bytes_per_head
    heads = kv_heads_per_rank(spec, tp)
    return heads * (2 * spec.head_dim * f.element_bytes + f.key_token_scale_bytes
                    + f.scale_bytes_per_head)


def kv_bytes_per_token(spec: ModelSpec, kv_dtype: str, *, tp: int = 1) -> int:
    """Bytes one rank stores per token across ALL layers, K and V, no window cap.

    This is what a paged cache that allocates every layer for every token (one block = all
    layers) spends per token; window savings need an allocator that reclaims (see below).
    """
    return spec.num_layers * kv_layer_bytes_per_token(spec, kv_dtype, tp=tp)


def kv_block_bytes(spec: ModelSpec, block_size: int, kv_dtype: str, *, tp: int = 1) -> int:
    """Bytes of one KV block (``block_size`` token slots, all layers) on one rank: its tokens,
    plus the per-block key scales of a per-channel-key format (``kv_block_scale_bytes``)."""
    if block_size < 1:
        raise PlanError(f"block size must be >= 1, got {block_size}")
    return block_size * kv_bytes_per_token(spec, kv_dtype, tp=tp) + kv_block_scale_bytes(
        spec, kv_dtype, tp=tp)


def kv_block_scale_bytes(spec: ModelSpec, kv_dtype: str, *, tp: int = 1) -> int:
    """Scale bytes one block holds whatever its fill, all layers: per-channel key scales
    (``num_layers x heads x head_dim x scale_bytes``), 0 for per-token / unscaled formats.

    NOTE: they do not shrink with the block: at block_size 16 and head_dim 64 an f32 scale per
    channel is 16 B per token per head, 4x a per-token scale; larger blocks amortise it.
    """
    f = kv_format(kv_dtype)
    if f.key_scales != "channel" or is_mla(spec):
        return 0
    return spec.num_layers * kv_heads_per_rank(spec, tp) * spec.head_dim * f.scale_bytes


def kv_fixed_bytes(spec: ModelSpec, kv_dtype: str) -> int:
    """Per-layer scales that do not grow with tokens (fp8: one f32 for K and V per layer)."""
    return spec.num_layers * kv_format(kv_dtype).scale_bytes_per_layer


def layer_kinds(spec: ModelSpec) -> tuple[str, ...]:
    """"full" or "sliding" per layer (Mistral's window applies to every layer)."""
    if spec.layer_types is not None:
        if len(spec.layer_types) != spec.num_layers:
            raise PlanError(f"layer_types has {len(spec.layer_types)} entries for "
                            f"{spec.num_layers} layers")
        return spec.layer_types
    kind = "sliding" if spec.sliding_window else "full"
    return (kind,) * spec.num_layers


@dataclass(frozen=True)
class RequestKV:
    """KV bytes one rank stores for one request at ``context`` tokens.

    ``bytes_all_layers``: every layer keeps every token (no reclaiming allocator).
    ``bytes_reclaimed``: sliding layers keep only their last ``window`` tokens.
    """

    context: int
    full_layers: int
    sliding_layers: int
    window: int | None
    bytes_all_layers: int
    bytes_reclaimed: int

    @property
    def window_saving(self) -> float:
        """Fraction saved by reclaiming: (sliding/layers) x (1 - window/context)."""
        return 1.0 - self.bytes_reclaimed / self.bytes_all_layers if self.bytes_all_layers else 0.0


def request_kv(spec: ModelSpec, context: int, kv_dtype: str, *, tp: int = 1) -> RequestKV:
    """KV bytes for one request of ``context`` tokens, with and without window reclaiming."""
    kinds = layer_kinds(spec)
    per_layer = kv_layer_bytes_per_token(spec, kv_dtype, tp=tp)
    sliding = sum(k == "sliding" for k in kinds)
    window = spec.sliding_window if sliding else None
    if sliding and not window:
        raise PlanError("sliding layers need a sliding_window")
    capped = min(context, window) if window else context
    all_layers = spec.num_layers * per_layer * context
    reclaimed = (spec.num_layers - sliding) * per_layer * context + sliding * per_layer * capped
    return RequestKV(context, spec.num_layers - sliding, sliding, window, all_layers, reclaimed)


@dataclass(frozen=True)
class SharingBlocks:
    """KV blocks of ``sharers`` sequences (n samples or beams) over one prompt, as fitserve's
    paged cache holds them, without and with block sharing.

    Unshared, each sequence holds ceil((P + T) / block) blocks. Shared, the prompt's full blocks,
    floor(P / block), are held once (ref counts) and each sequence holds the rest privately:
    its copy of the partial last prompt block (copy-on-write on its first new token) and the
    blocks of its own T new tokens. That is exact for n samples (their new tokens differ from
    the first) and an upper bound for beams, which also share their common generated history.

    The beam floor: beams that all descend from one beam of the previous step share every
    token but the last, so the full blocks of the first P + T - 1 tokens are held once and each
    beam holds only the block(s) from there on (T = 0: nothing generated, the n-samples figure)::

        floor((P + T - 1) / block) + k x (ceil((P + T) / block) - floor((P + T - 1) / block))
    """

    sharers: int
    prompt_tokens: int
    new_tokens: int
    block_size: int
    unshared: int  # blocks
    shared: int  # blocks
    shared_prompt_blocks: int  # held once
    private_blocks_each: int
    beam_floor: int = 0  # blocks: beams sharing all but their last token (see above)


def sharing_blocks(prompt_tokens: int, new_tokens: int, sharers: int, block_size: int
                   ) -> SharingBlocks:
    """Blocks for ``sharers`` sequences of ``prompt_tokens`` + ``new_tokens`` (see SharingBlocks)."""
    if sharers < 1 or prompt_tokens < 0 or new_tokens < 0 or block_size < 1:
        raise PlanError(f"sharing needs sharers >= 1, tokens >= 0 and block size >= 1 (got "
                        f"{sharers}, {prompt_tokens}, {new_tokens}, {block_size})")
    total = -(-(prompt_tokens + new_tokens) // block_size)
    full = prompt_tokens // block_size
    private = total - full
    shared = full + sharers * private
    common = (prompt_tokens + new_tokens - 1) // block_size if new_tokens else full
    return SharingBlocks(sharers, prompt_tokens, new_tokens, block_size, sharers * total,
                         shared, full, private, common + sharers * (total - common))


def window_blocks_held(block_size: int, computed: int, total: int, window: int | None) -> int:
    """Blocks one sequence's table holds in a layer group once it has slots for ``total``
    tokens, ``computed`` of them computed: every block for a full group; for a windowed group
    (fitserve.kv.group) only those from the block of ``computed - window + 1`` on, the first
    key the next query can see::

        window 5, block 4, computed 14, total 15:  ceil(15 / 4) - (14 - 5 + 1) // 4 = 4 - 2 = 2
    """
    if block_size < 1 or not 0 <= computed <= total:
        raise PlanError(f"need block size >= 1 and 0 <= computed <= total (got {block_size}, "
                        f"{computed}, {total})")
    first = max(0, computed - window + 1) // block_size if window else 0
    return max(0, -(-total // block_size) - first)


def window_span_blocks(window: int, block_size: int, chunk: int = 1) -> int:
    """The most blocks a windowed group holds for one sequence computing ``chunk`` new tokens:
    keys ``s - window + 1 .. s + chunk - 1`` span ``window + chunk - 1`` positions, which touch
    at most ``ceil((window + chunk - 2) / block_size) + 1`` blocks (decode: chunk 1)."""
    if window < 1 or block_size < 1 or chunk < 1:
        raise PlanError(f"need window, block size and chunk >= 1 (got {window}, {block_size}, {chunk})")
    return -(-(window + chunk - 2) // block_size) + 1
