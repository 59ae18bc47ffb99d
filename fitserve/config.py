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
    # "fcfs" | "priority" | "slo" (fitserve.sched.slo documents the rules)
    scheduling_policy: str = "fcfs"
    # slo: the server's targets (a request may bring its own), and what happens to a request
    # predicted to miss its TTFT target: "reject" (429) or "deprioritize"
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    slo_action: str = "reject"
    # the share of each target the slo rules plan for (fitserve.sched.slo.SLOTargets.headroom)
    slo_headroom: float = 0.85


SPECULATIVE_METHODS = ("ngram", "draft_model", "eagle")


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """vLLM's ``speculative_config``: who proposes ``num_speculative_tokens`` draft tokens per
    step for the target to verify in one forward.

    ``ngram`` (prompt lookup): the longest n-gram (``prompt_lookup_max`` down to
    ``prompt_lookup_min`` tokens) that ends the sequence and occurred earlier in it; the tokens
    that followed it are the draft. ``draft_model`` / ``eagle``: ``model`` is the draft model's
    path (a model sharing the target's tokenizer) or the EAGLE-like head's file.
    """

    method: str
    num_speculative_tokens: int
    model: str | None = None
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    # vLLM's disable_by_batch_size: no drafts while this many requests (or more) are running,
    # where verification's extra FLOPs cost more than the drafts save (the planner's
    # crossover batch: fitserve plan --speculative k,alpha,draft_cost)
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config method must be one of {', '.join(SPECULATIVE_METHODS)}, "
                             f"got {self.method!r}")
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= 16:
            raise ValueError(f"speculative_config num_speculative_tokens must be an integer in [1, 16], got {k!r}")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
            raise ValueError(f"speculative_config needs 1 <= prompt_lookup_min <= prompt_lookup_max, got {lo}, {hi}")
        d = self.disable_by_batch_size
        if d is not None and (isinstance(d, bool) or not isinstance(d, int) or d < 1):
            raise ValueError(f"speculative_config disable_by_batch_size must be an integer >= 1, got {d!r}")
        if self.method != "ngram" and not self.model:
            raise ValueError(f"speculative_config method {self.method!r} needs a model")

    @classmethod
    def from_dict(cls, d: dict[str, object]) -> SpeculativeConfig:
        """From vLLM-style JSON/dict; an unknown key is an error naming it."""
        known = {"method", "num_speculative_tokens", "model", "prompt_lookup_max", "prompt_lookup_min",
                 "disable_by_batch_size"}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"speculative_config has unknown keys {unknown}; known: {sorted(known)}")
        if "method" not in d or "num_speculative_tokens" not in d:
            raise ValueError("speculative_config needs 'method' and 'num_speculative_tokens'")
        return cls(**d)  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything needed to start an engine; "auto" values are resolved by fitserve.engine.builder."""

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
    # How the weights are held (fitserve.ledger.formats.engine_tensor_format per tensor):
    # "auto" = "as-stored" (GGUF Q4_0/Q4_1/Q8_0 packed as stored, the rest in the model dtype;
    # an HF folder in the model dtype), "bf16" | "float32" (every weight dense in that dtype,
    # which is then the model dtype), "int4" | "int8" (RTN at load, see plan.formats.RTN_FORMATS).
    weights: str = "auto"
    # vLLM's spelling of RTN at load: None | "int4" | "int8" (the same as weights="int4"/"int8").
    quantization: str | None = None
    # True: every step runs eager. False: CPU decode-only steps run under torch.compile
    # (fitserve.runner.compiled_step), compiled at start-up for the batch classes max_num_seqs reaches.
    enforce_eager: bool = True
    # Automatic prefix caching (vLLM's): full KV blocks are kept under a hash of their prefix
    # and reused by later requests that share it (fitserve.kv.prefix_hash).
    enable_prefix_caching: bool = True
    # KV cache element format (vLLM's --kv-cache-dtype): "auto" = the model dtype, or
    # "fp8" (= "fp8_e4m3") | "fp8_e5m2" | "int8" codes with float32 scales laid out as
    # kv_cache_scales says: "token" (K and V per token) or "channel-key" (K per channel per
    # block, V per token); "auto": channel-key for int8, token for fp8
    # (fitserve.ledger.formats.resolve_engine_kv_format).
    kv_cache_dtype: str = "auto"
    kv_cache_scales: str = "auto"
    # Scheduling (vLLM's --scheduling-policy, plus "slo"): "fcfs" | "priority" | "slo", the
    # SLO targets and action (see SchedulerConfig), and the step-time model "slo" uses: a JSON
    # file, or None for the one saved for this model and machine under
    # $FITSERVE_HOME/step-models (measured at start-up when there is none).
    scheduling_policy: str = "fcfs"
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    slo_action: str = "reject"
    step_model: str | None = None
    # Tensor parallelism (vLLM's tensor_parallel_size): this many processes on torch.distributed
    # (gloo), each holding 1/N of the heads, MLP and vocabulary (fitserve.dist)
    tensor_parallel_size: int = 1
    # Speculative decoding (off by default): a SpeculativeConfig or its vLLM-style dict
    speculative_config: SpeculativeConfig | dict[str, object] | None = field(default=None, hash=False)
