"""Model sampling defaults: generation_config.json and GGUF general.sampling.* read into one
dataclass, resolved against the server's defaults, and filled into requests that omit them."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import gguf
import pytest

from fitserve.loading import ModelLoadError
from fitserve.loading.generation_defaults import (
    GGUF_KEYS,
    NEUTRAL,
    SAMPLING_FIELDS,
    SERVER_DEFAULTS,
    GenerationDefaults,
    from_hf_generation_config,
    gguf_scalar_metadata,
    read_generation_defaults,
    resolve_default_sampling,
)
from fitserve.sampling import SamplingParams
from fitserve.server.protocol.chat import ChatCompletionRequest
from fitserve.server.protocol.common import DEFAULTED_FIELDS
from fitserve.server.protocol.completions import CompletionRequest


def write_sampling_gguf(path: Path, with_arrays: bool = True, **sampling: float | int) -> Path:
    """A metadata-only GGUF with gguf's own add_sampling_* writers (and arrays to skip past)."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("meta-only")
    if with_arrays:
        writer.add_token_list(["a", "bb", "ccc" * 50, ""])
        writer.add_token_types([1, 1, 3, 1])
        writer.add_array("test.nested", [["x", "yy"], ["z"]])
    for key, value in sampling.items():
        getattr(writer, f"add_sampling_{key}")(value)
    writer.add_context_length(512)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# -- Hugging Face generation_config.json --------------------------------------------------------
def test_hf_generation_config_agrees_with_transformers(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GenerationConfig(do_sample=True, temperature=0.6, top_p=0.9, top_k=20,
                                        min_p=0.05, repetition_penalty=1.1)
    cfg.save_pretrained(tmp_path)  # transformers writes the file; we read it back independently
    ref = transformers.GenerationConfig.from_pretrained(tmp_path)
    got = read_generation_defaults(tmp_path)
    assert got.values() == {name: getattr(ref, name) for name in SAMPLING_FIELDS}
    assert got.source == "generation_config.json"
    assert read_generation_defaults(tmp_path / "config.json") == got  # the config.json path works


def test_do_sample_false_keeps_only_the_repetition_penalty() -> None:
    data = {"do_sample": False, "temperature": 0.6, "top_p": 0.9, "top_k": 5, "min_p": 0.1,
            "repetition_penalty": 1.2}
    assert from_hf_generation_config(data).values() == {"repetition_penalty": 1.2}
    assert from_hf_generation_config({**data, "do_sample": True}).values() == {
        "temperature": 0.6, "top_p": 0.9, "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.2}
    absent = {k: v for k, v in data.items() if k != "do_sample"}
    assert from_hf_generation_config(absent).values() == from_hf_generation_config(
        {**data, "do_sample": True}).values()
    assert from_hf_generation_config({"do_sample": False, "temperature": 0.6}).is_empty
    assert from_hf_generation_config({"do_sample": False, "temperature": 0.6}).source is None


def test_types_are_normalised_and_bad_values_ignored(caplog: pytest.LogCaptureFixture) -> None:
    got = from_hf_generation_config({"temperature": 1, "top_k": 40.0, "top_p": None})
    assert got.values() == {"temperature": 1.0, "top_k": 40}
    assert isinstance(got.temperature, float) and isinstance(got.top_k, int)
    bad = {"temperature": -0.5, "top_p": 0.0, "top_k": 2.5, "min_p": "0.1",
           "repetition_penalty": True}
    with caplog.at_level(logging.WARNING, logger="fitserve.loading"):
        assert from_hf_generation_config(bad, "x/generation_config.json").is_empty
    assert len(caplog.records) == 5 and all("ignoring invalid default" in r.message for r in caplog.records)
    # a valid field next to an invalid one is kept
    assert from_hf_generation_config({"temperature": float("nan"), "top_p": 0.5}).values() == {"top_p": 0.5}


def test_folder_without_or_with_a_broken_generation_config(tmp_path: Path) -> None:
    assert read_generation_defaults(tmp_path) == GenerationDefaults()
    (tmp_path / "generation_config.json").write_text("{not json")
    assert read_generation_defaults(tmp_path).is_empty
    (tmp_path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    assert read_generation_defaults(tmp_path).is_empty  # what save_pretrained writes for most models


# -- GGUF general.sampling.* ------------------------------------------------------------------
def test_gguf_keys_are_the_gguf_package_constants() -> None:
    k = gguf.Keys.General
    assert GGUF_KEYS == {k.SAMPLING_TEMP: "temperature", k.SAMPLING_TOP_P: "top_p",
                         k.SAMPLING_TOP_K: "top_k", k.SAMPLING_MIN_P: "min_p",
                         k.SAMPLING_PENALTY_REPEAT: "repetition_penalty"}


def test_gguf_sampling_keys_written_by_gguf(tmp_path: Path) -> None:
    path = write_sampling_gguf(tmp_path / "m.gguf", temp=0.6, top_p=0.95, top_k=20, min_p=0.05,
                               penalty_repeat=1.1)
    got = read_generation_defaults(path)
    # stored as float32; shown as the decimal the author wrote (the same float32)
    assert got.values() == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.05,
                            "repetition_penalty": 1.1}
    assert got.source == "GGUF general.sampling.*"
    assert read_generation_defaults(write_sampling_gguf(tmp_path / "n.gguf")).is_empty
    partial = read_generation_defaults(write_sampling_gguf(tmp_path / "p.gguf", temp=0.0))
    assert partial.values() == {"temperature": 0.0}


def test_scalar_scan_matches_gguf_reader(tmp_path: Path) -> None:
    path = write_sampling_gguf(tmp_path / "m.gguf", temp=0.7, top_k=3)
    reader = gguf.GGUFReader(str(path))
    ref = {k: f.contents() for k, f in reader.fields.items()
           if not k.startswith("GGUF.") and f.types[0] != gguf.GGUFValueType.ARRAY}
    assert gguf_scalar_metadata(path) == ref
    assert "general.name" in ref and "tokenizer.ggml.tokens" not in ref  # arrays were skipped
    assert gguf_scalar_metadata(path, {"llama.context_length": None}) == {"llama.context_length": 512}


def test_corrupt_gguf_metadata_is_a_load_error(tmp_path: Path) -> None:
    path = write_sampling_gguf(tmp_path / "m.gguf", temp=0.7)
    data = path.read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="cut.gguf: unreadable GGUF metadata"):
        read_generation_defaults(tmp_path / "cut.gguf")
    (tmp_path / "junk.gguf").write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        read_generation_defaults(tmp_path / "junk.gguf")


# -- resolution: request > --default-* flag > model file > server built-in -----------------------
def test_model_without_defaults_gets_the_server_defaults() -> None:
    d = resolve_default_sampling(GenerationDefaults())
    assert d.values == SERVER_DEFAULTS and set(d.sources.values()) == {"server default"}
    SamplingParams(**d.values)  # type: ignore[arg-type]  # a valid set
    assert d.describe().startswith("temperature=0.8 (server default), top_p=0.95 (server default)")


def test_model_defaults_win_and_the_rest_are_neutral() -> None:
    model = GenerationDefaults(temperature=0.6, top_p=0.9, source="generation_config.json")
    d = resolve_default_sampling(model)
    assert d.values == {**NEUTRAL, "temperature": 0.6, "top_p": 0.9}
    assert d.sources["temperature"] == d.sources["top_p"] == "model generation_config.json"
    assert d.sources["top_k"].startswith("neutral")
    # neutral means SamplingParams' own defaults (OpenAI/vLLM)
    plain = SamplingParams()
    assert {name: getattr(plain, name) for name in SAMPLING_FIELDS} == NEUTRAL
    # --generation-config vllm ignores the model's file
    assert resolve_default_sampling(model, "vllm").values == SERVER_DEFAULTS


def test_explicit_flags_override_model_and_server() -> None:
    model = GenerationDefaults(temperature=0.0, source="GGUF general.sampling.*")
    d = resolve_default_sampling(model, overrides={"top_k": 7, "temperature": None})
    assert d.values["temperature"] == 0.0 and d.sources["temperature"] == "model GGUF general.sampling.*"
    assert d.values["top_k"] == 7 and d.sources["top_k"] == "--default-top-k"
    d = resolve_default_sampling(GenerationDefaults(), "vllm", {"repetition_penalty": 1.3})
    assert d.values == {**SERVER_DEFAULTS, "repetition_penalty": 1.3}
    assert d.sources["repetition_penalty"] == "--default-repetition-penalty"
    with pytest.raises(ValueError, match="--default-top-p: invalid value 1.5"):
        resolve_default_sampling(GenerationDefaults(), overrides={"top_p": 1.5})
    with pytest.raises(ValueError, match="unknown sampling default 'seed'"):
        resolve_default_sampling(GenerationDefaults(), overrides={"seed": 1})
    with pytest.raises(ValueError, match="'auto' or 'vllm'"):
        resolve_default_sampling(GenerationDefaults(), "hf")  # type: ignore[arg-type]


# -- the protocol fills only what the request omitted --------------------------------------------
def test_protocol_fills_omitted_fields_only() -> None:
    assert DEFAULTED_FIELDS == SAMPLING_FIELDS
    defaults = {"temperature": 0.8, "top_p": 0.95, "top_k": 40, "min_p": 0.05, "repetition_penalty": 1.0}
    omitted = CompletionRequest.model_validate_json('{"prompt": "x"}')
    assert omitted.temperature is None  # omitted is distinguishable from given
    filled = omitted.with_defaults(defaults)
    assert {k: getattr(filled, k) for k in DEFAULTED_FIELDS} == defaults
    assert omitted.temperature is None  # a copy; the parsed request is unchanged
    given = CompletionRequest.model_validate_json(
        '{"prompt": "x", "temperature": 0, "top_k": 0, "top_p": 1, "min_p": null}')
    g = given.with_defaults(defaults)
    assert (g.temperature, g.top_k, g.top_p, g.min_p, g.repetition_penalty) == (0, 0, 1, 0.05, 1.0)
    chat = ChatCompletionRequest.model_validate_json(
        '{"messages": [{"role": "user", "content": "hi"}], "temperature": 1.5}')
    c = chat.with_defaults(defaults)
    assert c.temperature == 1.5 and c.top_k == 40 and c.presence_penalty is None
    assert omitted.with_defaults({}) is omitted
