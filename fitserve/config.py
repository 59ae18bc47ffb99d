"""Frozen configuration records shared by every part of fitserve.

No I/O and no torch here: loaders build a :class:`ModelSpec` from model files, the planner reads
it, the engine sizes itself from it. Resolving "auto" values is a pure function elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass, field

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """RoPE frequency scaling (Hugging Face ``rope_scaling``); ``kind`` is "llama3" or "linear"."""

    kind: str
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """The architecture facts of a decoder-only transformer, as in a Hugging Face config.json.

    ``architecture`` is one of SUPPORTED_ARCHITECTURES for models the engine runs; the planner
    also accepts others (e.g. "mixtral", "deepseek_v3") through the optional fields below.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    # NOTE: llama.cpp/GGUF "neox" style is split halves; HF Llama uses split halves too after
    # the GGUF loader undoes llama.cpp's Q/K permutation, so the model only needs this flag.
    rope_interleaved: bool = False
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v projections (Qwen2)
    qk_norm: bool = False  # RMSNorm on per-head q and k (Qwen3)
    sliding_window: int | None = None  # tokens a query sees, itself included (Mistral)
    # Per-layer attention kind for hybrid models ("full" or "sliding"); None means all one kind.
    layer_types: tuple[str, ...] | None = None
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = ""
    # Planner-only extensions (mixture of experts, MLA); the engine rejects specs that use them.
    num_experts: int = 0
    num_experts_per_token: int = 0
    moe_intermediate_size: int = 0
    extra: dict[str, float | int | str] = field(default_factory=dict, hash=False, compare=False)
    # Planner-only: mixture of experts beyond the basics (DeepSeek-V3: 1 shared expert, the
    # first 3 layers dense) and multi-head latent attention (MLA). kv_lora_rank > 0 means MLA:
    # the cache holds kv_lora_rank + qk_rope_head_dim per token per layer, shared by all heads.
    num_shared_experts: int = 0
    first_k_dense: int = 0
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """One token budget per step, shared by prompt chunks and decodes."""

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    max_model_len: int = 2048
    # Largest chunk a single request may take in one step (None = the whole budget).
    long_prefill_token_threshold: int | None = None


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything needed to start an engine; "auto" values are resolved by fitserve.engine_setup."""

    model: str = "smollm2-135m"
    dtype: str = "auto"  # "float32" | "bfloat16" | "float16" | "auto"
    device: str = "auto"  # "cpu" | "cuda" | "auto"
    max_model_len: int | None = None  # None = the model's max_position_embeddings
    block_size: int = 16
    num_kv_blocks: int | None = None  # None = size the pool from kv_cache_memory_bytes
    kv_cache_memory_bytes: int | None = None  # None = 1 GiB on CPU, the ledger's plan on CUDA
    gpu_memory_utilization: float = 0.9
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    long_prefill_token_threshold: int | None = None
    seed: int = 0
    # How the weights are held (fitserve.plan.formats.engine_tensor_format per tensor):
    # "auto" = "as-stored" (GGUF Q4_0/Q4_1/Q8_0 packed as stored, the rest in the model dtype;
    # an HF folder in the model dtype), "bf16" | "float32" (every weight dense in that dtype,
    # which is then the model dtype), "int4" | "int8" (RTN at load, see plan.formats.RTN_FORMATS).
    weights: str = "auto"
    # vLLM's spelling of RTN at load: None | "int4" | "int8" (the same as weights="int4"/"int8").
    quantization: str | None = None
    # True: every step runs eager. False: CPU decode-only steps run under torch.compile
    # (fitserve.compiled_step), compiled at start-up for the batch classes max_num_seqs reaches.
    enforce_eager: bool = True
    # Automatic prefix caching (vLLM's): full KV blocks are kept under a hash of their prefix
    # and reused by later requests that share it (fitserve.kv.prefix_hash).
    enable_prefix_caching: bool = True
