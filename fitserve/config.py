"""Frozen configuration records shared by every part of fitserve.

No I/O and no torch here: loaders build a :class:`ModelSpec` from model files, the planner reads
it, the engine sizes itself from it. Resolving "auto" values is a pure function elsewhere.

:class:`EngineConfig` nests the parts other layers take whole (vLLM's ``VllmConfig``):
:class:`SchedulerConfig`, :class:`CacheConfig` and :class:`SpeculativeConfig`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Literal, get_args

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "gemma3_text",
                           "phi3", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "qwen2moe",
                           "qwen3moe", "gpt_oss", "gpt-oss")
# Mixture-of-experts families the engine runs (fitserve.model.moe), by their Hugging Face names;
# llama.cpp spells two of them without the underscore (a GGUF spec takes the HF name) and writes
# Mixtral as "llama" with an expert count.
MOE_ARCHITECTURES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss")
# Gemma 2/3 (fitserve.model.gemma): 4 norms a layer, (1 + w) RMSNorm, GeGLU, scaled embedding.
# "gemma3" is llama.cpp's name (and the multimodal HF config's) for the text decoder
# transformers calls gemma3_text.
GEMMA_ARCHITECTURES = ("gemma2", "gemma3", "gemma3_text")


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """RoPE frequency scaling (Hugging Face ``rope_scaling``); ``kind`` is "llama3", "linear",
    "longrope" (Phi-3's LongRoPE / "su": per-frequency ``short_factor`` and ``long_factor``
    divisors, cos/sin multiplied by ``attention_factor``) or "yarn" (``factor``, the ramp
    between ``beta_fast`` and ``beta_slow`` rotations, ``truncate``; cos/sin multiplied by
    ``attention_factor``)."""

    kind: str
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True


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
    # "head": q/k norms per head over head_dim (Qwen3); "projection": over the whole q / k
    # projection, all heads at once (OLMoE)
    qk_norm_scope: str = "head"
    sliding_window: int | None = None  # tokens a query sees, itself included (Mistral)
    # Per-layer attention kind for hybrid models ("full" or "sliding"); None means all one kind.
    layer_types: tuple[str, ...] | None = None
    hidden_act: str = "silu"
    # Gemma 2/3: attention scale query_pre_attn_scalar**-0.5 (None: head_dim**-0.5), scores and
    # final logits soft-capped as tanh(s / cap) * cap (None: not capped)
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    # Per-layer-type RoPE (Gemma 3): the "sliding" layers rotate with this base and no scaling;
    # None: every layer uses rope_theta / rope_scaling
    sliding_rope_theta: float | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = ""
    # Mixture of experts (the engine runs MOE_ARCHITECTURES; fitserve.model.moe). Experts are
    # moe_intermediate_size wide (0: intermediate_size, Mixtral/OLMoE); the routing weights of
    # the top num_experts_per_token are renormalised to sum 1 when norm_topk_prob (Mixtral
    # always). Qwen2-MoE adds one shared expert of shared_expert_intermediate_size, scaled by
    # sigmoid(shared_expert_gate(x)). A layer is sparse when (i + 1) % decoder_sparse_step == 0
    # and i is not in mlp_only_layers (nor below first_k_dense); the others run a dense MLP of
    # intermediate_size.
    num_experts: int = 0
    num_experts_per_token: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    shared_expert_intermediate_size: int = 0
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
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
    def expert_intermediate_size(self) -> int:
        """The width of one routed expert's MLP."""
        return self.moe_intermediate_size or self.intermediate_size

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer ``layer`` runs the sparse expert block (else a dense MLP)."""
        return (self.num_experts > 0 and layer >= self.first_k_dense
                and layer not in self.mlp_only_layers
                and (layer + 1) % max(1, self.decoder_sparse_step) == 0)

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


# The string settings with a fixed set of values (vLLM's spellings). The tuples of allowed
# values are derived from these, so a check and its type cannot disagree.
DType = Literal["auto", "float32", "bfloat16", "float16"]
Device = Literal["auto", "cpu", "cuda"]  # NOTE: "cuda:N" is accepted too (fitserve.runner.placement.resolve_device)
WeightsChoice = Literal["auto", "as-stored", "bf16", "float32", "float16", "int8", "int4", "fp8"]
Quantization = Literal["int4", "int8", "fp8"]
# What packed int4/int8 weights multiply (--activation-quant): "int8" = x quantized to int8 per
# 32 columns, integer dot products (W4A8 / W8A8, llama.cpp's Q8 activations); "none" = x as is
# (bf16 / fp32), weights dequantized in registers (weight-only, W4A16); "auto" = int8 for bf16
# activations, none for float32.
ActivationQuant = Literal["auto", "int8", "none"]
KVCacheDType = Literal["auto", "bfloat16", "float16", "float32", "fp8", "fp8_e4m3", "fp8_e5m2", "int8"]
KVCacheScales = Literal["auto", "token", "channel-key"]
SchedulingPolicy = Literal["fcfs", "priority", "slo"]
SLOAction = Literal["reject", "deprioritize"]
SpeculativeMethod = Literal["ngram", "draft_model", "eagle"]

SCHEDULING_POLICIES: tuple[SchedulingPolicy, ...] = get_args(SchedulingPolicy)
SLO_ACTIONS: tuple[SLOAction, ...] = get_args(SLOAction)
SPECULATIVE_METHODS: tuple[SpeculativeMethod, ...] = get_args(SpeculativeMethod)


@dataclass(frozen=True, slots=True)
class SLOTargets:
    """The server's targets in seconds (None: no target) and what to do with a late request."""

    ttft_s: float | None = None
    tpot_s: float | None = None
    action: SLOAction = "reject"
    # the rules plan for this share of each target, so that the model's error (held-out p90
    # ~20% here) and the steps' jitter land inside the target rather than half above it
    headroom: float = 0.85

    def __post_init__(self) -> None:
        for name in ("ttft_s", "tpot_s"):
            v = getattr(self, name)
            if v is not None and not (math.isfinite(v) and v > 0):
                raise ValueError(f"SLO target {name} must be > 0, got {v!r}")
        if not 0 < self.headroom <= 1:
            raise ValueError(f"slo headroom must be in (0, 1], got {self.headroom!r}")
        if self.action not in SLO_ACTIONS:
            raise ValueError(f"slo action must be one of {', '.join(SLO_ACTIONS)}, got {self.action!r}")


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """One token budget per step, shared by prompt chunks and decodes."""

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    # NOTE: inside an EngineConfig this is a placeholder: the engine replaces it with the
    # length it resolves from EngineConfig.max_model_len and the model.
    max_model_len: int = 2048
    # Largest chunk a single request may take in one step (None = the whole budget).
    long_prefill_token_threshold: int | None = None
    # fitserve.sched.slo documents the policies
    scheduling_policy: SchedulingPolicy = "fcfs"
    # slo: the server's targets (a request may bring its own), and what happens to a request
    # predicted to miss its TTFT target: "reject" (429) or "deprioritize"
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    slo_action: SLOAction = "reject"
    # the share of each target the slo rules plan for (SLOTargets.headroom)
    slo_headroom: float = 0.85

    def validate(self) -> None:
        """The scheduler's own checks (ValueError); the SLO targets are :meth:`slo_targets`'."""
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError(
                "max_num_batched_tokens and max_num_seqs must be >= 1, got "
                f"{self.max_num_batched_tokens} and {self.max_num_seqs}"
            )
        t = self.long_prefill_token_threshold
        if t is not None and t < 1:
            raise ValueError(f"long_prefill_token_threshold must be >= 1 or None, got {t}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling policy must be one of {', '.join(SCHEDULING_POLICIES)}, "
                             f"got {self.scheduling_policy!r}")

    def slo_targets(self) -> SLOTargets:
        """The slo policy's targets in seconds (ValueError if a setting is bad)."""
        ttft, tpot = self.slo_ttft_ms, self.slo_tpot_ms
        return SLOTargets(None if ttft is None else ttft / 1000, None if tpot is None else tpot / 1000,
                          self.slo_action, self.slo_headroom)


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """The paged KV cache: its blocks, its size, its element format and prefix caching."""

    block_size: int = 16
    num_kv_blocks: int | None = None  # None = size the pool from kv_cache_memory_bytes
    kv_cache_memory_bytes: int | None = None  # None = 1 GiB on CPU, the ledger's plan on CUDA
    gpu_memory_utilization: float = 0.9
    # CPU: the engine's whole budget as a share of the RAM available at start-up (None: the KV
    # pool is kv_cache_memory_bytes or the fixed default); set with --gpu-memory-utilization
    host_memory_utilization: float | None = None
    # Automatic prefix caching (vLLM's): full KV blocks are kept under a hash of their prefix
    # and reused by later requests that share it (fitserve.kv.prefix_hash).
    enable_prefix_caching: bool = True
    # KV cache element format (vLLM's --kv-cache-dtype): "auto" = the model dtype, or
    # "fp8" (= "fp8_e4m3") | "fp8_e5m2" | "int8" codes with float32 scales laid out as
    # kv_cache_scales says: "token" (K and V per token) or "channel-key" (K per channel per
    # block, V per token); "auto": channel-key for int8, token for fp8
    # (fitserve.ledger.formats.resolve_engine_kv_format).
    kv_cache_dtype: KVCacheDType = "auto"
    kv_cache_scales: KVCacheScales = "auto"


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """vLLM's ``speculative_config``: who proposes ``num_speculative_tokens`` draft tokens per
    step for the target to verify in one forward.

    ``ngram`` (prompt lookup): the longest n-gram (``prompt_lookup_max`` down to
    ``prompt_lookup_min`` tokens) that ends the sequence and occurred earlier in it; the tokens
    that followed it are the draft. ``draft_model`` / ``eagle``: ``model`` is the draft model's
    path (a model sharing the target's tokenizer) or the EAGLE-like head's file.
    """

    method: SpeculativeMethod
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
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"speculative_config has unknown keys {unknown}; known: {sorted(known)}")
        if "method" not in d or "num_speculative_tokens" not in d:
            raise ValueError("speculative_config needs 'method' and 'num_speculative_tokens'")
        return cls(**d)  # type: ignore[arg-type]

    @classmethod
    def of(cls, value: SpeculativeConfig | dict[str, object] | None) -> SpeculativeConfig | None:
        """``speculative_config=`` as given to EngineConfig: a SpeculativeConfig, its vLLM-style
        dict, or None (speculation off)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, dict):
            return cls.from_dict(value)
        raise ValueError(f"speculative_config must be a dict or SpeculativeConfig, got {type(value).__name__}")


_SCHEDULER_KEYS = tuple(f.name for f in fields(SchedulerConfig) if f.name != "max_model_len")
_CACHE_KEYS = tuple(f.name for f in fields(CacheConfig))
_UNSET: Any = object()


@dataclass(frozen=True, slots=True, init=False)
class EngineConfig:
    """Everything needed to start an engine; "auto" values are resolved by fitserve.engine.sizing.

    ``EngineConfig(model=..., max_num_seqs=4, block_size=16, speculative_config={...})``: the
    flat keyword names of vLLM's engine arguments go to the nested config that holds them
    (``scheduler``: every SchedulerConfig field but max_model_len; ``cache``: every
    CacheConfig field; ``speculative_config``: a SpeculativeConfig or its dict). Nested configs
    may be passed whole; flat keywords given beside one apply on top of it, so
    ``dataclasses.replace(cfg, max_num_seqs=8)`` works. :meth:`flat_kwargs` is the inverse.
    """

    model: str
    dtype: DType
    device: Device
    max_model_len: int | None  # None = the model's max_position_embeddings
    seed: int
    # How the weights are held (fitserve.ledger.formats.engine_tensor_format per tensor):
    # "auto" = "as-stored" (GGUF Q4_0/Q4_1/Q8_0 packed as stored, the rest in the model dtype;
    # an HF folder in the model dtype), "bf16" | "float32" (every weight dense in that dtype,
    # which is then the model dtype), "int4" | "int8" (RTN at load, see plan.formats.RTN_FORMATS).
    weights: WeightsChoice
    # vLLM's spelling of RTN at load (the same as weights="int4"/"int8"/"fp8").
    quantization: Quantization | None
    # the activations packed int4/int8 weights multiply (ActivationQuant above)
    activation_quant: ActivationQuant
    # True: every step runs eager. False: CPU decode-only steps run under torch.compile
    # (fitserve.runner.compiled_step), compiled at start-up for the batch classes max_num_seqs reaches.
    enforce_eager: bool
    # The step-time model the "slo" scheduling policy uses: a JSON file, or None for the one
    # saved for this model and machine under $FITSERVE_HOME/step-models (measured at start-up
    # when there is none).
    step_model: str | None
    # Tensor parallelism (vLLM's tensor_parallel_size): this many processes on torch.distributed
    # (gloo), each holding 1/N of the heads, MLP and vocabulary (fitserve.dist)
    tensor_parallel_size: int
    scheduler: SchedulerConfig
    cache: CacheConfig
    # Speculative decoding (None: off)
    speculative: SpeculativeConfig | None

    def __init__(
        self,
        model: str = "smollm2-135m",
        *,
        dtype: DType = "auto",
        device: Device = "auto",
        max_model_len: int | None = None,
        seed: int = 0,
        weights: WeightsChoice = "auto",
        quantization: Quantization | None = None,
        activation_quant: ActivationQuant = "auto",
        enforce_eager: bool = True,
        step_model: str | None = None,
        tensor_parallel_size: int = 1,
        scheduler: SchedulerConfig | None = None,
        cache: CacheConfig | None = None,
        speculative: SpeculativeConfig | None = None,
        speculative_config: SpeculativeConfig | dict[str, object] | None = _UNSET,
        **flat: Any,
    ) -> None:
        unknown = sorted(set(flat) - set(_SCHEDULER_KEYS) - set(_CACHE_KEYS))
        if unknown:
            raise TypeError(f"EngineConfig.__init__() got an unexpected keyword argument {unknown[0]!r}")
        sched = {k: v for k, v in flat.items() if k in _SCHEDULER_KEYS}
        kv = {k: v for k, v in flat.items() if k in _CACHE_KEYS}
        if speculative_config is not _UNSET:
            speculative = SpeculativeConfig.of(speculative_config)
        own = {"model": model, "dtype": dtype, "device": device, "max_model_len": max_model_len,
               "seed": seed, "weights": weights, "quantization": quantization,
               "activation_quant": activation_quant, "enforce_eager": enforce_eager, "step_model": step_model,
               "tensor_parallel_size": tensor_parallel_size,
               "scheduler": replace(scheduler or SchedulerConfig(), **sched),
               "cache": replace(cache or CacheConfig(), **kv), "speculative": speculative}
        for name, value in own.items():
            object.__setattr__(self, name, value)  # NOTE: frozen: the one way to set a field

    def flat_kwargs(self) -> dict[str, Any]:
        """The flat keywords that rebuild this config (plain values, JSON-ready):
        ``EngineConfig(**cfg.flat_kwargs()) == cfg`` (scheduler.max_model_len aside, which
        the engine sets)."""
        own = {f.name: getattr(self, f.name) for f in fields(self)
               if f.name not in ("scheduler", "cache", "speculative")}
        sched = {k: getattr(self.scheduler, k) for k in _SCHEDULER_KEYS}
        spec = None if self.speculative is None else asdict(self.speculative)
        return {**own, **sched, **asdict(self.cache), "speculative_config": spec}

    def validate(self) -> None:
        """Every check on the settings alone (no model, no device): a ValueError naming the
        flag. The engine and `fitserve serve` call it before the model loads."""
        self._validate_scheduling()
        self.scheduler.validate()
        if self.activation_quant not in get_args(ActivationQuant):
            raise ValueError(f"--activation-quant must be one of {', '.join(get_args(ActivationQuant))}, "
                             f"got {self.activation_quant!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len}")
        if self.speculative is not None and self.tensor_parallel_size > 1:
            raise ValueError("speculative decoding (--speculative-config) does not run with "
                             f"--tensor-parallel-size {self.tensor_parallel_size} yet")

    def _validate_scheduling(self) -> None:
        """A bad --scheduling-policy / SLO flag, named."""
        s = self.scheduler
        policy = s.scheduling_policy
        if policy not in SCHEDULING_POLICIES:
            raise ValueError(f"--scheduling-policy must be one of {', '.join(SCHEDULING_POLICIES)}, got {policy!r}")
        ttft, tpot = s.slo_ttft_ms, s.slo_tpot_ms
        if policy != "slo":
            if ttft is not None or tpot is not None or self.step_model is not None:
                raise ValueError("--slo-ttft-ms, --slo-tpot-ms and --step-model apply to "
                                 f"--scheduling-policy slo, not {policy!r}")
            return
        if ttft is None and tpot is None:
            raise ValueError("--scheduling-policy slo needs a target: --slo-ttft-ms and/or --slo-tpot-ms")
        try:
            s.slo_targets()
        except ValueError as exc:
            raise ValueError(f"bad SLO setting: {exc} (--slo-ttft-ms / --slo-tpot-ms in ms, "
                             "--slo-action reject|deprioritize)") from None
