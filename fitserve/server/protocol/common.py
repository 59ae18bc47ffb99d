"""What the OpenAI routes share: the server's limits, the fields a client may not set, the
sampling fields of both generation requests, and the response parts both write (usage, errors,
the model list).

Requests are validated in strict mode straight from the JSON bytes, so ``"max_tokens": "5"`` or
``"n": 1.5`` is a 400, not a silent coercion. A field no model declares is ignored with a warning
in the log naming it (vLLM's rule: ``extra="allow"`` plus a warning; clients send fields of newer
API versions), except the ones listed in :data:`REJECTED_FIELDS`: OpenAI's and vLLM's fields for
features fitserve does not have, each a 400 naming it (:data:`ACCEPTED_VALUES`: their values
that ask for nothing fitserve lacks, such as ``store: false``). A chat template a client sends is code: it runs only on a server started with
``--trust-request-chat-template`` (``fitserve.server.chat_render``). Every field a model declares has an effect (or is checked and refused): none is accepted
and dropped. ``user`` (OpenAI's end-user id) goes into the server's debug log of the request.

Sampling fields default to ``None`` so that "omitted" and "given" differ: an omitted
temperature/top_p/top_k/min_p/repetition_penalty is filled by :meth:`SamplingFields.with_defaults`
from the defaults the server put in force (the model's recommended ones, else the server's; see
``fitserve.loading.generation_defaults``), a given one is kept as sent.

The field descriptions, and the bounds the server enforces (stated in the JSON schema only, see
:func:`desc`), make up the request schemas of the OpenAPI document
(``fitserve.server.openapi``); the response models' serialization schemas are its response
schemas. Response models are closed (extra="forbid": no other key is ever written), and in a body
every key is always written, defaults included; stream chunks (CHUNK) leave some keys out.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field

from fitserve.server.protocol.structured import ResponseFormat, StructuredOutputs

MAX_N = 16  # children per request: each one holds KV blocks, so n is a memory multiplier
MAX_STOP_SEQUENCES = 16
MAX_STOP_LENGTH = 256
MAX_PROMPTS_PER_REQUEST = 64
MAX_MESSAGES = 512
MAX_STOP_TOKEN_IDS = 64  # serving.py's limit (it has its own constant), stated in the OpenAPI document

# Fields a client may not set: features fitserve does not have, and silently ignoring them would
# change results. (The chat-template fields are protocol.chat.ChatTemplateFields.)
REJECTED_FIELDS: dict[str, str] = {
    "documents": "client-supplied chat template arguments are not accepted",
    "functions": "the legacy `functions` field is not supported: use `tools`",
    "function_call": "the legacy `function_call` field is not supported: use `tool_choice`",
    "suffix": "suffix (text after the completion, for insertion) is not supported",
    "guided_whitespace_pattern": "guided_whitespace_pattern is not supported (JSON output is compact)",
    # OpenAI's fields for features fitserve does not have (a value in ACCEPTED_VALUES passes)
    "service_tier": "service_tier: fitserve has one tier; only `auto` or `default` are accepted",
    "store": "store is not supported: fitserve stores no completions",
    "metadata": "metadata is not supported: it tags stored completions, and fitserve stores none",
    "modalities": "modalities: fitserve generates text only (`[\"text\"]`)",
    "audio": "audio output is not supported",
    "prediction": "prediction (predicted outputs) is not supported",
    "web_search_options": "web_search_options is not supported: fitserve has no web search",
    "reasoning_effort": "reasoning_effort is not supported: use chat_template_kwargs for a model's thinking switch",
    # vLLM's extras fitserve does not have
    "prompt_embeds": "prompt_embeds is not supported: send text or token ids",
    "logits_processors": "logits_processors (server-side Python) are not supported",
    "guided_decoding_backend": "guided_decoding_backend: fitserve has one grammar backend (llguidance)",
    "kv_transfer_params": "kv_transfer_params: fitserve has no disaggregated prefill",
    "vllm_xargs": "vllm_xargs (custom logits processor arguments) are not supported",
    "mm_processor_kwargs": "mm_processor_kwargs: fitserve serves text-only models",
    "cache_salt": "cache_salt is not supported: the prefix cache is shared by every request (--no-prefix-caching)",
    "return_token_ids": "return_token_ids is not supported: use logprobs with return_tokens_as_token_ids",
}
# Values of a REJECTED_FIELDS entry that ask for what fitserve does anyway (OpenAI's defaults).
ACCEPTED_VALUES: dict[str, tuple[object, ...]] = {
    "service_tier": ("auto", "default"), "store": (False,), "modalities": (["text"],),
}
# Tokenizer routes (/tokenize): the same, but a completion's suffix is not theirs to refuse.
TOKENIZE_REJECTED_FIELDS: dict[str, str] = {k: v for k, v in REJECTED_FIELDS.items() if k != "suffix"}
MAX_LOGIT_BIAS = 1024  # entries of one request's logit_bias

# Request fields an omitted value of which takes the server's default (not SamplingParams').
DEFAULTED_FIELDS: tuple[str, ...] = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")

STRICT = ConfigDict(strict=True, extra="ignore")
BODY = ConfigDict(extra="forbid", json_schema_serialization_defaults_required=True)
CHUNK = ConfigDict(extra="forbid")
NonNegInt = Annotated[int, Field(ge=0)]
StopField = str | list[str] | None


def desc(default: Any, description: str, **by_type: dict[str, Any]) -> Any:
    """A field with a description and bounds that exist in its JSON schema only.

    ``by_type`` maps a JSON type ("integer", "number", "string", "array") to the keywords that
    go into the non-null branch of that type (an ``"items"`` or ``"additionalProperties"`` entry is
    merged into the one pydantic wrote). Validation does not change: the server checks these bounds itself (``serving.py``,
    ``SamplingParams``), with its own messages; the schema only says what it will accept, for
    the OpenAPI document (``fitserve.server.openapi``) and for clients.
    """

    def extra(schema: dict[str, Any]) -> None:
        branches = [b for b in schema.get("anyOf", [schema]) if b.get("type") != "null"]
        for b in branches:
            for key, value in by_type.get(b.get("type", ""), {}).items():
                if key in ("items", "additionalProperties") and isinstance(b.get(key, {}), dict):
                    b.setdefault(key, {}).update(value)
                else:
                    b[key] = value

    return Field(default, description=description, json_schema_extra=extra)


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = Field(False, description="Send a last chunk with `usage` (and no choices) "
                                                   "before `data: [DONE]`.")
    continuous_usage_stats: bool = Field(False, description="vLLM extension: `usage` in every chunk. Not "
                                                            "supported: true is a 400.")


class SamplingFields(BaseModel):
    """Sampling fields common to both endpoints; ranges are checked by SamplingParams."""

    model_config = STRICT

    model: str | None = desc(None, "The served model's id (see GET /v1/models); any other value is a 404. "
                                   "Optional in fitserve (required by OpenAI).")
    n: int = desc(1, f"Choices to generate for each prompt, 1..{MAX_N} (OpenAI allows up to 128). "
                     "With `use_beam_search` it is the beam width: the n best beams are returned.",
                  integer={"minimum": 1, "maximum": MAX_N})
    temperature: float | None = desc(None, "Sampling temperature >= 0 (0 is greedy); unlike OpenAI no upper "
                                           "bound of 2. Omitted: the server's default (the model's recommended "
                                           "one, else 1; see `sampling_defaults` in GET /v1/models).",
                                     number={"minimum": 0})
    top_p: float | None = desc(None, "Nucleus sampling mass, in (0, 1]. Omitted: the server's default.",
                               number={"exclusiveMinimum": 0, "maximum": 1})
    top_k: int | None = desc(None, "vLLM extension (not OpenAI): sample from the k most likely tokens; 0 or -1 "
                                   "disable it. Omitted: the server's default.", integer={"minimum": -1})
    min_p: float | None = desc(None, "vLLM extension (not OpenAI): drop tokens less likely than min_p times the "
                                     "most likely one, in [0, 1]. Omitted: the server's default.",
                               number={"minimum": 0, "maximum": 1})
    presence_penalty: float | None = desc(None, "OpenAI's presence penalty, in [-2, 2]; default 0.",
                                          number={"minimum": -2, "maximum": 2})
    frequency_penalty: float | None = desc(None, "OpenAI's frequency penalty, in [-2, 2]; default 0.",
                                           number={"minimum": -2, "maximum": 2})
    repetition_penalty: float | None = desc(None, "vLLM extension (not OpenAI): multiplicative penalty on tokens "
                                                  "already seen, > 0 (1 is none). Omitted: the server's default.",
                                            number={"exclusiveMinimum": 0})
    seed: int | None = desc(None, "Seed of the request's own random stream (any integer, taken modulo 2**64); "
                                  "choice j uses seed + j.")
    stop: StopField = desc(None, f"Up to {MAX_STOP_SEQUENCES} stop strings (OpenAI allows 4) of 1.."
                                 f"{MAX_STOP_LENGTH} characters; the text stops before the first one.",
                           string={"minLength": 1, "maxLength": MAX_STOP_LENGTH},
                           array={"maxItems": MAX_STOP_SEQUENCES,
                                  "items": {"minLength": 1, "maxLength": MAX_STOP_LENGTH}})
    stop_token_ids: list[NonNegInt] | None = desc(None, f"vLLM extension (not OpenAI): up to {MAX_STOP_TOKEN_IDS} "
                                                        "token ids that end the text (kept out of it).",
                                                  array={"maxItems": MAX_STOP_TOKEN_IDS})
    ignore_eos: bool = desc(False, "vLLM extension (not OpenAI): keep generating past the end-of-sequence token.")
    skip_special_tokens: bool = desc(True, "vLLM extension (not OpenAI): leave special tokens out of the text.")
    spaces_between_special_tokens: bool | None = desc(
        None, "vLLM extension (not OpenAI): fitserve decodes as vLLM's fast detokenizer does, with no spaces "
              "added around special tokens; `true` with `skip_special_tokens: false` is a 400.")
    min_tokens: int = desc(0, "vLLM extension (not OpenAI): EOS, `stop_token_ids` and `stop` strings do not end "
                              "the output before this many tokens (<= max_tokens).", integer={"minimum": 0})
    allowed_token_ids: list[NonNegInt] | None = desc(
        None, "vLLM extension (not OpenAI): only these token ids may be generated (non-empty, each in "
              "[0, vocabulary size)).", array={"minItems": 1})
    bad_words: list[str] | None = desc(
        None, "vLLM extension (not OpenAI): words never generated: a word's last token is banned wherever the "
              "output ends with the tokens before it (tokenized with and without a leading space).")
    truncate_prompt_tokens: int | None = desc(
        None, "vLLM extension (not OpenAI): keep only the last N prompt tokens (N >= 1, or -1: the context "
              "length); N over the context length is a 400.", integer={"minimum": -1})
    return_tokens_as_token_ids: bool | None = desc(
        None, "vLLM extension (not OpenAI): logprobs name each token as `token_id:N` instead of its text.")
    include_stop_str_in_output: bool = desc(False, "vLLM extension (not OpenAI): keep the matched stop string "
                                                   "at the end of the text.")
    stream: bool = desc(False, "Stream the result as server-sent events (text/event-stream), one chunk per "
                               "new piece of text, ending with `data: [DONE]`.")
    stream_options: StreamOptions | None = desc(None, "Only allowed when `stream` is true (else a 400).")
    user: str | None = desc(None, "OpenAI's end-user id: written to the server's debug log of the request "
                                  "(with --log-level debug); it changes nothing else.")
    logit_bias: dict[str, float] | None = desc(
        None, f"OpenAI's: token id (as a string) -> a bias in [-100, 100] added to its logit before sampling "
              f"(-100 bans it, 100 all but forces it); ids in [0, vocabulary size), at most {MAX_LOGIT_BIAS}.",
        object={"propertyNames": {"pattern": "^(0|[1-9][0-9]{0,8})$"},
                "additionalProperties": {"minimum": -100, "maximum": 100},
                "maxProperties": MAX_LOGIT_BIAS})
    # structured output: at most one of these (a 400 otherwise)
    response_format: ResponseFormat | None = desc(
        None, "OpenAI's: `text` (no constraint), `json_object` (the output is a JSON object) or `json_schema` "
              "(it matches `json_schema.schema`). At most one of this and the guided_* fields.")
    guided_json: dict[str, Any] | str | None = desc(
        None, "vLLM extension (not OpenAI): the output matches this JSON schema (an object, or its JSON text).")
    guided_regex: str | None = desc(None, "vLLM extension (not OpenAI): the whole output matches this regular "
                                          "expression (Rust regex syntax: no look-arounds or backreferences).",
                                    string={"minLength": 1})
    guided_choice: list[str] | None = desc(None, "vLLM extension (not OpenAI): the output is exactly one of "
                                                 "these strings (non-empty, at least one).",
                                           array={"minItems": 1, "items": {"minLength": 1}})
    guided_grammar: str | None = desc(None, "vLLM extension (not OpenAI): the output matches this context-free "
                                            "grammar, GBNF (llama.cpp's) or Lark (llguidance's syntax).",
                                      string={"minLength": 1})
    structured_outputs: StructuredOutputs | None = desc(
        None, "vLLM extension (its newer form of the guided_* fields): exactly one of json, regex, choice, "
              "grammar, json_object.")
    # vLLM's extension: beam search with n beams returned (``n`` is the beam width)
    use_beam_search: bool = desc(False, "vLLM extension (not OpenAI): beam search of width `n`, the beams "
                                        "returned as choices, best first. Not with `stream`, `logprobs`, `stop` "
                                        "or `stop_token_ids` (a 400).")
    length_penalty: float = desc(1.0, "vLLM extension (not OpenAI): beam search only, beams are ranked by "
                                      "cumulative logprob / length**length_penalty.")
    # vLLM's: lower runs first (needs --scheduling-policy priority; any other value is a 400)
    priority: int = desc(0, "vLLM extension (not OpenAI): lower runs first. Needs a server started with "
                            "--scheduling-policy priority; elsewhere any value but 0 is a 400.")
    # fitserve's: this request's own targets under --scheduling-policy slo (ms, > 0)
    slo_ttft_ms: float | None = desc(None, "fitserve extension: this request's time-to-first-token target in "
                                           "ms (> 0), replacing the server's under --scheduling-policy slo "
                                           "(which may answer 429 when it predicts a miss).",
                                     number={"exclusiveMinimum": 0})
    slo_tpot_ms: float | None = desc(None, "fitserve extension: this request's time-per-output-token target "
                                           "in ms (> 0), under --scheduling-policy slo.",
                                     number={"exclusiveMinimum": 0})

    def with_defaults(self, defaults: Mapping[str, float | int]) -> Self:
        """A copy whose omitted (None) fields among DEFAULTED_FIELDS take ``defaults``' values."""
        fill = {k: v for k, v in defaults.items() if k in DEFAULTED_FIELDS and getattr(self, k) is None}
        return self.model_copy(update=fill) if fill else self


# fitserve.types.FinishReason's values, and "tool_calls" (a chat choice that ended in tool calls)
FinishReasonName = Literal["stop", "length", "abort", "error", "tool_calls"]
StopReason = str | int | None  # the stop string or stop token id that ended a choice; null: EOS or length


def absent_or_value(schema: dict[str, Any]) -> None:
    """A stream key that is either left out or has a value (never null)."""
    branches = [b for b in schema.pop("anyOf", []) if b.get("type") != "null"]
    if branches:
        schema.update(branches[0] if len(branches) == 1 else {"anyOf": branches})
    schema.pop("default", None)


class PromptTokensDetails(BaseModel):
    model_config = BODY
    cached_tokens: int = Field(description="Prompt tokens served from the prefix cache.")


class Usage(BaseModel):
    model_config = BODY
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class ErrorBody(BaseModel):
    model_config = BODY
    message: str
    type: str = Field(description="invalid_request_error, authentication_error, not_found_error, "
                                  "rate_limit_error, server_error or service_unavailable.")
    param: str | None = Field(None, description="The request field at fault, when there is one.")
    code: str | int | None = None


class ErrorResponse(BaseModel):
    """Every 4xx/5xx body (and an error event in a stream): the OpenAI error shape."""

    model_config = BODY
    error: ErrorBody


class ModelCard(BaseModel):
    model_config = BODY
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "fitserve"
    max_model_len: int | None = None
    # fitserve extras: what a request that omits a sampling field gets, and where it came from
    sampling_defaults: dict[str, float | int] | None = Field(
        None, description="fitserve extension: what a request that omits a sampling field gets.")
    sampling_defaults_source: dict[str, str] | None = Field(
        None, description="fitserve extension: where each of sampling_defaults comes from.")


class ModelList(BaseModel):
    model_config = BODY
    object: Literal["list"] = "list"
    data: list[ModelCard]


