"""Constrained decoding on the real SmolLM2 (fp32): every output is checked by an independent
validator, never by the grammar library that produced it.

- JSON schemas drawn by hypothesis: the output parses (``json``) and validates (``jsonschema``);
- regex outputs ``re.fullmatch``; choice outputs are one of the choices; a GBNF grammar's output
  matches the same language written as a Python regex;
- greedy decoding under a regex that the unconstrained greedy text already matches gives the
  same tokens (the mask only removes tokens greedy would not pick);
- unconstrained requests batched with constrained ones give exactly their solo tokens;
- preemption (recompute) and speculative decoding leave constrained outputs unchanged;
- an invalid schema / regex / grammar is a ValueError naming the problem, and nothing is held;
- logit_bias +100 makes greedy pick a token, -100 bans it.
"""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fitserve.config import EngineConfig, SpeculativeConfig
from fitserve.engine.core import Engine
from fitserve.loading import LoadedModel
from fitserve.sampling import SamplingParams
from fitserve.sampling.beam_search import BeamSearchParams
from fitserve.structured.guided import GuidedDecoding
from fitserve.types import FinishReason, RequestOutput

PLAIN_PROMPT = "The capital of France is"
JSON_PROMPT = "Reply with a short JSON object about a cat."


@pytest.fixture(scope="module")
def engine(smollm2_loaded: LoadedModel) -> Engine:
    return Engine(EngineConfig(model=str(smollm2_loaded.path), dtype="float32", device="cpu",
                               max_model_len=512, num_kv_blocks=128), loaded=smollm2_loaded)


def chat(engine: Engine, text: str) -> str:
    return engine.tokenizer.apply_chat_template([{"role": "user", "content": text}])


def run(engine: Engine, requests: list[tuple[str, SamplingParams]]) -> list[RequestOutput]:
    """Add every (prompt, params) at once and step until all are done; outputs in order."""
    ids = [engine.add_request(prompt, params) for prompt, params in requests]
    done: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                assert out.error is None, out.error
                done[out.request_id] = out
    assert engine.kv.stats().used_blocks == 0
    return [done[i] for i in ids]


def guided(kind: str, value: Any = "", **kw: Any) -> SamplingParams:
    text = value if isinstance(value, str) else json.dumps(value)
    kw.setdefault("max_tokens", 48)
    kw.setdefault("temperature", 0.0)
    return SamplingParams(guided=GuidedDecoding(kind, text), **kw)


# -- JSON schemas drawn by hypothesis ------------------------------------------------------------
# Bounded (string lengths, integer ranges, array sizes) so every output fits max_tokens: a
# request cut by max_tokens could not be checked.
_LEAVES = st.one_of(
    st.integers(1, 8).map(lambda n: {"type": "string", "maxLength": n}),
    st.tuples(st.integers(-50, 50), st.integers(0, 100)).map(
        lambda t: {"type": "integer", "minimum": t[0], "maximum": t[0] + t[1]}),
    st.just({"type": "boolean"}),
    st.lists(st.text("abcxyz", min_size=1, max_size=5), min_size=1, max_size=4, unique=True).map(
        lambda xs: {"enum": xs}),
    st.integers(1, 3).map(lambda n: {"type": "array", "maxItems": n,
                                     "items": {"type": "integer", "minimum": 0, "maximum": 9}}),
)
_NAMES = st.sampled_from(["id", "name", "ok", "tags", "score", "kind", "note"])


def _object(values: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
    def build(props: dict[str, dict[str, Any]], data: st.DataObject) -> dict[str, Any]:
        # mostly required (else "{}" would satisfy too many schemas), at most one optional
        optional = data.draw(st.lists(st.sampled_from(sorted(props)), max_size=1))
        return {"type": "object", "properties": props,
                "required": [n for n in props if n not in optional],
                "additionalProperties": False}

    return st.builds(build, st.dictionaries(_NAMES, values, min_size=1, max_size=3), st.data())


SCHEMAS = _object(st.one_of(_LEAVES, _object(_LEAVES)))


@settings(max_examples=5, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(st.lists(SCHEMAS, min_size=5, max_size=5))
def test_json_schema_outputs_validate(engine: Engine, schemas: list[dict[str, Any]]) -> None:
    prompt = chat(engine, JSON_PROMPT)
    outs = run(engine, [(prompt, guided("json_schema", s, temperature=1.0, seed=i, max_tokens=64))
                        for i, s in enumerate(schemas)])
    for schema, out in zip(schemas, outs, strict=True):
        assert out.finish_reason == FinishReason.STOP, (schema, out.text)
        jsonschema.validate(json.loads(out.text), schema)


# -- regex, choice, grammar, and the unconstrained neighbours -----------------------------------
REGEX = r"[A-Z][a-z]+ (is|was) [0-9]{1,3} years old\."
CHOICES = ["Paris", "London", "Berlin"]
# GBNF (llama.cpp) and the same language as a Python regex, the independent check
GBNF = 'root ::= "Name: " name ", age " [0-9] [0-9]?\nname ::= [A-Z] [a-z]+'
GBNF_AS_REGEX = r"Name: [A-Z][a-z]+, age [0-9][0-9]?"
PLAIN = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def solo(engine: Engine) -> RequestOutput:
    return run(engine, [(PLAIN_PROMPT, PLAIN)])[0]


def test_constrained_kinds_and_unconstrained_neighbours(engine: Engine, solo: RequestOutput) -> None:
    question = chat(engine, "Which city is the capital of France?")
    requests = [
        (PLAIN_PROMPT, PLAIN),
        (chat(engine, "How old is Tom?"), guided("regex", REGEX, temperature=0.8, seed=1)),
        (question, guided("choice", CHOICES)),
        (question, guided("choice", CHOICES, temperature=1.0, seed=2)),
        (chat(engine, "Introduce yourself."), guided("grammar", GBNF, temperature=0.8, seed=3)),
        (chat(engine, "Give a JSON object with the keys name and age of a cat."),
         guided("json_object", temperature=0.8, seed=4)),
        ("Once upon a time", SamplingParams(temperature=0.7, seed=5, max_tokens=24)),
    ]
    outs = run(engine, requests)
    assert outs[0].token_ids == solo.token_ids  # batched with constrained rows: unchanged
    assert re.fullmatch(REGEX, outs[1].text), outs[1].text
    assert outs[2].text in CHOICES and outs[3].text in CHOICES
    assert re.fullmatch(GBNF_AS_REGEX, outs[4].text), outs[4].text
    assert isinstance(json.loads(outs[5].text), dict)
    for out in outs[1:6]:
        assert out.finish_reason == FinishReason.STOP, out.text
    # the seeded unconstrained neighbour: its solo tokens too
    assert run(engine, [requests[-1]])[0].token_ids == outs[-1].token_ids


def _regex_for(text: str) -> str:
    """A regex (same meaning in Python and in llguidance's Rust syntax) that ``text`` matches:
    runs of letters, digits and whitespace generalised to classes, other ASCII escaped \\xHH.

    NOTE: a literal run of several characters would not do: llguidance allows only the
    canonical tokenization of text the grammar forces ("\\n\\n" as one token, where the model
    may write two), so greedy would then differ from the unconstrained greedy for that reason.
    """
    classes = {"a": "[A-Za-z]+", "0": "[0-9]+", " ": "\\s+"}
    parts = []
    for m in re.finditer(r"[A-Za-z]+|[0-9]+|\s+|.", text, re.S):
        s = m.group()
        kind = "a" if s[0].isascii() and s[0].isalpha() else "0" if s[0] in "0123456789" else (
            " " if s.isspace() else "")
        parts.append(classes[kind] if kind else "".join(
            f"\\x{ord(c):02x}" if c.isascii() else c for c in s))
    return "".join(parts)


def test_greedy_unchanged_when_its_text_already_matches(engine: Engine, solo: RequestOutput) -> None:
    pattern = _regex_for(solo.text)
    assert re.fullmatch(pattern, solo.text) and pattern != re.escape(solo.text)
    out = run(engine, [(PLAIN_PROMPT, guided("regex", pattern, max_tokens=24, ignore_eos=True))])[0]
    assert out.token_ids == solo.token_ids
    # and not vacuous: a regex the greedy text does not match changes the output
    other = run(engine, [(PLAIN_PROMPT, guided("regex", "[0-9]{1,2} apples", max_tokens=24))])[0]
    assert re.fullmatch("[0-9]{1,2} apples", other.text) and other.token_ids != solo.token_ids[:len(other.token_ids)]


def test_n_children_each_follow_the_grammar(engine: Engine) -> None:
    params = [guided("regex", r"[a-z]{3}-[0-9]{2}", temperature=1.0, seed=10 + j) for j in range(3)]
    ids = engine.add_requests(chat(engine, "Make up a code."), params)
    done: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    texts = [done[i].text for i in ids]
    assert all(re.fullmatch(r"[a-z]{3}-[0-9]{2}", t) for t in texts), texts
    assert len(set(texts)) > 1  # each child its own matcher: they really went their own ways


# -- preemption and speculative decoding -----------------------------------------------------------
def test_preemption_and_speculation_leave_constrained_outputs_alone(
        engine: Engine, smollm2_loaded: LoadedModel) -> None:
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                                "age": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["name", "age"], "additionalProperties": False}
    prompts = [chat(engine, f"Describe person number {i} as JSON.") for i in range(3)]
    want = run(engine, [(p, guided("json_schema", schema)) for p in prompts])
    # a pool too small for everyone (9 blocks of 16 tokens: preemptions) and n-gram drafts
    small = Engine(EngineConfig(model=str(smollm2_loaded.path), dtype="float32", device="cpu",
                                max_model_len=128, num_kv_blocks=9,
                                speculative_config=SpeculativeConfig(method="ngram", num_speculative_tokens=3,
                                                                     prompt_lookup_min=1, prompt_lookup_max=2)),
                   loaded=smollm2_loaded)
    repeat = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    got = run(small, [(p, guided("json_schema", schema)) for p in prompts]
              + [("a b a b a b a b a b a b", repeat)])
    assert small.scheduler.total_preemptions > 0
    assert got[-1].num_draft_tokens > 0  # the unconstrained request did speculate
    for w, g in zip(want, got[:-1], strict=True):
        assert g.num_draft_tokens == 0
        assert g.token_ids == w.token_ids
        jsonschema.validate(json.loads(g.text), schema)


# -- errors ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("kind", "value", "needle"), [
    ("json_schema", "{not json", "not valid JSON"),
    ("json_schema", '{"type": "frobnicate"}', "frobnicate"),
    ("regex", "a(?=b)", "look-around"),
    ("regex", "[a-", "unclosed"),
    ("grammar", 'root ::= "a" undefined_rule', "undefined_rule"),
    ("choice", "[]", "non-empty"),
])
def test_invalid_grammar_is_a_value_error(engine: Engine, kind: str, value: str, needle: str) -> None:
    with pytest.raises(ValueError, match=re.escape(needle)) as err:
        engine.add_request(PLAIN_PROMPT, SamplingParams(guided=GuidedDecoding(kind, value)))
    assert f"guided {kind}" in str(err.value)
    assert not engine.has_unfinished_requests()
    assert engine.kv.stats().used_blocks == 0 and engine.scheduler.num_waiting == 0


def test_beam_search_refuses_a_grammar(engine: Engine) -> None:
    with pytest.raises(ValueError, match="beam search"):
        engine.add_beam_search(PLAIN_PROMPT, BeamSearchParams(beam_width=2, max_tokens=4),
                               guided=GuidedDecoding("regex", "[a-z]+"))
    assert not engine.has_unfinished_requests()


# -- logit bias -------------------------------------------------------------------------------------
def test_logit_bias_forces_and_bans(engine: Engine, solo: RequestOutput) -> None:
    first = solo.token_ids[0]
    target = engine.tokenizer.encode(" banana")[0]
    assert target != first
    short = {"temperature": 0.0, "max_tokens": 2, "ignore_eos": True}
    forced, banned, both = run(engine, [
        (PLAIN_PROMPT, SamplingParams(logit_bias={target: 100.0}, **short)),
        (PLAIN_PROMPT, SamplingParams(logit_bias={first: -100.0}, **short)),
        (PLAIN_PROMPT, SamplingParams(logit_bias={str(first): -100, target: 5.0}, **short)),
    ])
    assert forced.token_ids[0] == target
    assert banned.token_ids[0] != first
    assert first not in both.token_ids
    with pytest.raises(ValueError, match="logit_bias"):
        engine.add_request(PLAIN_PROMPT, SamplingParams(logit_bias={engine.spec.vocab_size: 1.0}))
    assert not engine.has_unfinished_requests()
