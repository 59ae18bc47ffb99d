"""Every field of the /v1/completions and /v1/chat/completions request schemas is honoured or refused.

:data:`FIELDS` registers each field (walked from the pydantic models, nested ``stream_options`` too)
either with the tests that fail if its effect is removed (``path::test``; MAP is this module's
check that the field reaches the engine's parameters, for fields whose effect is proven on
SamplingParams) or with a body that must be a 400 naming it. :data:`REJECTED_FIELDS` (OpenAI's and
vLLM's fields fitserve does not have) must each be a 400 naming the field, and an unknown field is
logged (vLLM's rule: ignored with a warning).
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import httpx
import pytest

from fitserve.loading.tokenizer import Tokenizer
from fitserve.server.errors import APIError
from fitserve.server.protocol.chat import ChatCompletionRequest
from fitserve.server.protocol.common import REJECTED_FIELDS, StreamOptions
from fitserve.server.protocol.completions import CompletionRequest
from fitserve.server.serving import ModelContext, prepare_chat, prepare_completion
from tests.e2e.conftest import API_KEY, MODEL, Server

ROOT = Path(__file__).resolve().parents[2]
ME = "tests/e2e/test_request_fields_walk.py"
MAP = f"{ME}::test_field_reaches_the_engine"
SAMPLER_DIST = "tests/unit/sampling/test_sampler.py::test_empirical_distribution_matches_reference"
PENALTIES = "tests/unit/sampling/test_sampler.py::test_penalties_match_reference_values"
EXTRAS = "tests/integration/test_sampling_extras_engine.py"
API = "tests/e2e/test_api.py"
STRUCT = "tests/e2e/test_structured_api.py"
TPL = "tests/e2e/test_chat_template_api.py::test_request_fields"
SLO = "tests/unit/sched/test_sched_slo.py"


class Refused:
    """A field refused (400 naming it) with the value(s) in ``body``."""

    def __init__(self, **body: Any) -> None:
        self.body = body


FIELDS: dict[str, tuple[str, ...] | Refused] = {
    "model": ("tests/e2e/test_errors.py::test_unknown_model_is_404",),
    "prompt": (f"{API}::test_completion_batch_prompts_and_token_ids",),
    "messages": (f"{API}::test_chat",),
    "n": (f"{API}::test_n_children_differ_and_seed_reproducible",),
    "max_tokens": (MAP, f"{EXTRAS}::test_allowed_token_ids_limit_every_token"),
    "max_completion_tokens": (MAP,),
    "temperature": (MAP, SAMPLER_DIST),
    "top_p": (MAP, SAMPLER_DIST),
    "top_k": (MAP, SAMPLER_DIST),
    "min_p": (MAP, SAMPLER_DIST),
    "presence_penalty": (MAP, PENALTIES),
    "frequency_penalty": (MAP, PENALTIES),
    "repetition_penalty": (MAP, PENALTIES),
    "seed": (MAP, f"{API}::test_n_children_differ_and_seed_reproducible"),
    "stop": (MAP, f"{API}::test_stop_strings"),
    "stop_token_ids": (MAP, f"{EXTRAS}::test_min_tokens_holds_off_eos_and_stop_tokens"),
    "ignore_eos": (MAP, f"{EXTRAS}::test_skip_special_tokens_keeps_or_drops_special_text"),
    "skip_special_tokens": (MAP, f"{EXTRAS}::test_skip_special_tokens_keeps_or_drops_special_text"),
    "spaces_between_special_tokens": Refused(skip_special_tokens=False, spaces_between_special_tokens=True),
    "include_stop_str_in_output": (MAP, "tests/integration/test_engine_outputs.py::"
                                        "test_final_text_keeps_the_character_cut_by_the_end"),
    "min_tokens": (MAP, f"{EXTRAS}::test_min_tokens_holds_off_eos_and_stop_tokens"),
    "allowed_token_ids": (MAP, f"{EXTRAS}::test_allowed_token_ids_limit_every_token",
                          f"{ME}::test_allowed_token_ids_over_http"),
    "bad_words": (MAP, f"{EXTRAS}::test_bad_words_never_appear",
                  "tests/unit/sampling/test_token_masks.py::test_masks_equal_the_plain_rules"),
    "truncate_prompt_tokens": (f"{ME}::test_truncate_prompt_tokens_keeps_the_last_tokens",),
    "return_tokens_as_token_ids": (f"{ME}::test_return_tokens_as_token_ids",),
    "logprobs": (f"{API}::test_logprobs",),
    "top_logprobs": (f"{API}::test_logprobs",),
    "echo": ("tests/e2e/test_fields_api.py::test_echo_prepends_the_prompt",
             "tests/e2e/test_prompt_logprobs_api.py::test_echo_max_tokens_0_scores_the_prompt"),
    "prompt_logprobs": ("tests/e2e/test_prompt_logprobs_api.py::test_vllm_prompt_logprobs_field",
                        "tests/numerics/test_prompt_logprobs.py::test_alone_and_batched"),
    "best_of": Refused(best_of=3, n=1),
    "stream": (f"{API}::test_chat_stream_matches_non_stream",),
    "stream_options": (f"{API}::test_chat_stream_matches_non_stream",),
    "stream_options.include_usage": (f"{API}::test_chat_stream_matches_non_stream",),
    "stream_options.continuous_usage_stats": Refused(stream=True, stream_options={"continuous_usage_stats": True}),
    "user": (MAP,),  # its effect is the request's debug log line, which reads Prepared.user
    "logit_bias": ("tests/e2e/test_fields_api.py::test_logit_bias_bans_and_forces_tokens",),
    "response_format": (f"{STRUCT}::test_json_schema",),
    "guided_json": (f"{STRUCT}::test_json_object_and_guided_json",),
    "guided_regex": (f"{STRUCT}::test_guided_regex",),
    "guided_choice": (f"{STRUCT}::test_guided_choice",),
    "guided_grammar": (f"{STRUCT}::test_guided_grammar",),
    "structured_outputs": (f"{STRUCT}::test_json_object_and_guided_json",),
    "use_beam_search": ("tests/e2e/test_beam_search_api.py::test_completion_beams_equal_offline_beam_search",),
    "length_penalty": (MAP, "tests/numerics/test_beam_search.py::test_beam_search_equals_dense_reference_and_transformers"),
    "priority": (MAP, f"{SLO}::test_priority_orders_the_queue_and_preempts_the_lowest_priority"),
    "slo_ttft_ms": (MAP, "tests/e2e/test_slo_server.py::test_unreachable_ttft_is_429_with_retry_after_and_the_server_keeps_serving"),
    "slo_tpot_ms": (MAP, f"{SLO}::test_tightest_tpot_among_the_decodes_sets_the_cap"),
    "tools": ("tests/e2e/test_tools_api.py::test_required_always_parses",),
    "tool_choice": ("tests/e2e/test_tools_api.py::test_named_function_streams_like_the_response",),
    "parallel_tool_calls": (f"{ME}::test_parallel_tool_calls_bounds_the_calls",),
    "add_special_tokens": (f"{ME}::test_add_special_tokens_adds_bos",),
    "chat_template": (TPL,),
    "chat_template_kwargs": (TPL,),
    "add_generation_prompt": (TPL,),
    "continue_final_message": (TPL,),
}

# A value of each REJECTED_FIELDS entry that asks for what fitserve does not have.
REJECTED_SAMPLES: dict[str, Any] = {
    "documents": [{"text": "x"}], "functions": [{"name": "f"}], "function_call": "auto", "suffix": " end",
    "guided_whitespace_pattern": " ", "service_tier": "flex", "store": True, "metadata": {"k": "v"},
    "modalities": ["text", "audio"], "audio": {"voice": "alloy"}, "prediction": {"type": "content"},
    "web_search_options": {"search_context_size": "low"}, "reasoning_effort": "low",
    "prompt_embeds": "AAAA", "logits_processors": ["m.f"], "guided_decoding_backend": "xgrammar",
    "kv_transfer_params": {"a": 1}, "vllm_xargs": {"a": 1}, "mm_processor_kwargs": {"a": 1},
    "cache_salt": "s", "return_token_ids": True,
}


def schema_fields() -> set[str]:
    names = set(CompletionRequest.model_fields) | set(ChatCompletionRequest.model_fields)
    return names | {f"stream_options.{k}" for k in StreamOptions.model_fields}


def _test_exists(ref: str) -> bool:
    path, name = ref.split("::")
    tree = ast.parse((ROOT / path).read_text())
    return any(isinstance(n, ast.FunctionDef) and n.name == name for n in tree.body)


def test_every_field_is_registered_with_existing_tests() -> None:
    missing = sorted(schema_fields() - set(FIELDS))
    assert not missing, f"request fields with neither an effect test nor a refusal registered: {missing}"
    stale = sorted(set(FIELDS) - schema_fields())
    assert not stale, f"registered fields the schemas no longer have: {stale}"
    refs = {ref for v in FIELDS.values() if isinstance(v, tuple) for ref in v}
    assert not [r for r in sorted(refs) if not _test_exists(r)]
    assert set(REJECTED_SAMPLES) == set(REJECTED_FIELDS)
    assert not set(REJECTED_FIELDS) & schema_fields()


# -- MAP: the field reaches the engine's parameters (their effect is tested on them) ---------------
@pytest.fixture(scope="module")
def ctx(smollm2_tokenizer_dir: Path) -> ModelContext:
    return ModelContext(MODEL, Tokenizer.from_folder(smollm2_tokenizer_dir), 2048, 49152, 0)


# field -> (value sent, the attribute of the engine request it sets, the value expected there)
MAPPED: dict[str, tuple[Any, str, Any]] = {
    "max_tokens": (7, "params.max_tokens", 7), "temperature": (0.5, "params.temperature", 0.5),
    "top_p": (0.5, "params.top_p", 0.5), "top_k": (5, "params.top_k", 5), "min_p": (0.2, "params.min_p", 0.2),
    "presence_penalty": (0.5, "params.presence_penalty", 0.5),
    "frequency_penalty": (0.5, "params.frequency_penalty", 0.5),
    "repetition_penalty": (1.3, "params.repetition_penalty", 1.3), "seed": (9, "params.seed", 9),
    "stop": (["x"], "params.stop", ["x"]), "stop_token_ids": ([5], "params.stop_token_ids", [5]),
    "ignore_eos": (True, "params.ignore_eos", True), "skip_special_tokens": (False, "params.skip_special_tokens", False),
    "include_stop_str_in_output": (True, "params.include_stop_str_in_output", True),
    "min_tokens": (3, "params.min_tokens", 3), "allowed_token_ids": ([12, 13], "params.allowed_token_ids", [12, 13]),
    "bad_words": (["cat"], "params.bad_words", ["cat"]), "user": ("u-1", "user", "u-1"),
    "priority": (2, "priority", 2), "slo_ttft_ms": (50.0, "slo_ttft_ms", 50.0),
    "slo_tpot_ms": (20.0, "slo_tpot_ms", 20.0),
}


@pytest.mark.parametrize("field", [*MAPPED, "max_completion_tokens", "length_penalty"])
def test_field_reaches_the_engine(ctx: ModelContext, field: str) -> None:
    if field == "max_completion_tokens":
        chat = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}],
                                                     "max_tokens": 9, "max_completion_tokens": 4})
        assert prepare_chat(chat, ctx).params.max_tokens == 4
        return
    if field == "length_penalty":
        req = CompletionRequest.model_validate({"prompt": "a", "n": 2, "use_beam_search": True,
                                                "length_penalty": 0.5})
        beam = prepare_completion(req, ctx).beam
        assert beam is not None and beam.length_penalty == 0.5
        return
    value, attr, expected = MAPPED[field]
    body = {field: value}
    for prep in (prepare_completion(CompletionRequest.model_validate({"prompt": "a", **body}), ctx),
                 prepare_chat(ChatCompletionRequest.model_validate(
                     {"messages": [{"role": "user", "content": "hi"}], **body}), ctx)):
        obj: Any = prep
        for part in attr.split("."):
            obj = getattr(obj, part)
        assert obj == expected, (field, obj)
        if attr.startswith("params."):  # and every child gets it
            assert all(getattr(c.params, attr[7:]) == expected for c in prep.children())


def test_parallel_tool_calls_bounds_the_calls(ctx: ModelContext) -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}

    def bound(choice: str, parallel: bool | None) -> int | None:
        req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}],
                                                    "tools": [tool], "tool_choice": choice,
                                                    "parallel_tool_calls": parallel})
        plan = prepare_chat(req, ctx).tools
        return plan.max_calls if plan is not None else None

    assert bound("auto", None) is None and bound("auto", False) == 1
    assert bound("required", None) == 1 and bound("required", True) == 8


def test_add_special_tokens_adds_bos(smollm2_tokenizer_dir: Path) -> None:
    tok = Tokenizer.from_folder(smollm2_tokenizer_dir, bos_token_id=0)
    tok.add_bos_token = True  # a model that uses BOS (SmolLM2 itself does not)
    bos_ctx = ModelContext(MODEL, tok, 2048, 49152, 0)
    text = tok.encode("Hello there", add_special_tokens=False)
    cmpl = {"prompt": "Hello there"}
    assert prepare_completion(CompletionRequest.model_validate(cmpl), bos_ctx).prompts == [[0, *text]]
    assert prepare_completion(CompletionRequest.model_validate({**cmpl, "add_special_tokens": False}),
                              bos_ctx).prompts == [text]
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    plain = prepare_chat(ChatCompletionRequest.model_validate(chat), bos_ctx).prompts[0]
    added = prepare_chat(ChatCompletionRequest.model_validate({**chat, "add_special_tokens": True}), bos_ctx).prompts[0]
    assert plain[0] != 0 and added == [0, *plain]


def test_truncate_prompt_tokens_in_preparation(ctx: ModelContext) -> None:
    ids = list(range(100, 140))
    req = CompletionRequest.model_validate({"prompt": ids, "truncate_prompt_tokens": 5})
    assert prepare_completion(req, ctx).prompts == [ids[-5:]]
    for bad in (0, 4096):
        with pytest.raises(APIError) as info:
            prepare_completion(CompletionRequest.model_validate({"prompt": ids, "truncate_prompt_tokens": bad}), ctx)
        assert info.value.param == "truncate_prompt_tokens"


# -- over HTTP, on the session server ------------------------------------------------------------
def _post(server: Server, body: dict[str, Any], path: str = "/v1/completions") -> httpx.Response:
    base = {"model": MODEL, "max_tokens": 4, "temperature": 0}
    base |= {"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "The capital of"}
    return httpx.post(f"{server.url}{path}", json={**base, **body},
                      headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120)


REFUSALS = [(k, v.body) for k, v in FIELDS.items() if isinstance(v, Refused)] + \
    [(k, {k: v}) for k, v in REJECTED_SAMPLES.items()]


@pytest.mark.parametrize(("field", "body"), REFUSALS, ids=[f for f, _ in REFUSALS])
def test_refused_fields_are_400_naming_them(server: Server, field: str, body: dict[str, Any]) -> None:
    path = "/v1/completions" if field in ("suffix", "best_of") else "/v1/chat/completions"
    r = _post(server, body, path)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field.split(".")[0], r.text


def test_accepted_values_of_rejected_fields_and_unknown_fields(server: Server) -> None:
    r = _post(server, {"service_tier": "auto", "store": False, "modalities": ["text"],
                       "no_such_field_xyz": 1}, "/v1/chat/completions")
    assert r.status_code == 200, r.text
    assert "no_such_field_xyz" in server.log.read_text()  # vLLM's warning names the ignored field


def test_allowed_token_ids_over_http(server: Server) -> None:
    r = _post(server, {"allowed_token_ids": [12, 13], "temperature": 1.0, "seed": 1, "logprobs": 0,
                       "return_tokens_as_token_ids": True, "max_tokens": 6, "ignore_eos": True})
    tokens = r.json()["choices"][0]["logprobs"]["tokens"]
    assert len(tokens) == 6 and set(tokens) <= {"token_id:12", "token_id:13"}, tokens


def test_return_tokens_as_token_ids(server: Server) -> None:
    plain = _post(server, {"logprobs": 2}).json()["choices"][0]
    ids = _post(server, {"logprobs": 2, "return_tokens_as_token_ids": True}).json()["choices"][0]
    tok = [int(t.removeprefix("token_id:")) for t in ids["logprobs"]["tokens"]]
    text = httpx.post(f"{server.url}/detokenize", json={"tokens": tok},
                      headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30).json()["prompt"]
    assert ids["text"] == plain["text"] == text and plain["logprobs"]["tokens"][0] != ids["logprobs"]["tokens"][0]
    assert all(k.startswith("token_id:") for top in ids["logprobs"]["top_logprobs"] for k in top)
    chat = _post(server, {"logprobs": True, "return_tokens_as_token_ids": True}, "/v1/chat/completions").json()
    assert all(c["token"].startswith("token_id:") for c in chat["choices"][0]["logprobs"]["content"])


def test_truncate_prompt_tokens_keeps_the_last_tokens(server: Server) -> None:
    prompt = "One two three four five six seven eight nine ten"
    ids = httpx.post(f"{server.url}/tokenize", json={"prompt": prompt},
                     headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30).json()["tokens"]
    cut = _post(server, {"prompt": prompt, "truncate_prompt_tokens": 3}).json()
    tail = _post(server, {"prompt": ids[-3:]}).json()
    assert cut["usage"]["prompt_tokens"] == 3 and cut["choices"][0]["text"] == tail["choices"][0]["text"]
