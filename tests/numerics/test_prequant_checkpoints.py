"""Pre-quantized Hugging Face checkpoints held as stored: compressed-tensors pack-quantized
(written and decompressed by compressed-tensors itself), GPTQ (act-order too) and AWQ (written
from the format spec, tests/prequant_writers.py) of a tiny random Llama.

Per checkpoint: each quantized weight lands in the engine format the config promises, and its
dequantization equals the writer's own (compressed-tensors' decompress, bit for bit in bf16;
``s * (q - z)`` in float64 for GPTQ/AWQ, exactly, or within the f16 rounding of the min for AWQ
with full-precision f16 scales); for one checkpoint per writer (and act-order), `fitserve plan
--gpu cpu` counts the very bytes the engine holds and the engine's greedy tokens match
transformers running the dequantized weights.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from fitserve.loading import load_model
from fitserve.loading.errors import ModelLoadError
from fitserve.model.linear import PackedLinear
from fitserve.model.permuted_linear import InputPermutedLinear
from fitserve.quant.held import HeldTensor
from fitserve.quant.permuted import InputPermutedWeight
from tests.numerics.test_plan_engine_packed import check
from tests.numerics.test_quantized_vs_transformers import EXACT_TOL, compare
from tests.prequant_writers import (
    Quantized,
    reference_model,
    write_awq,
    write_compressed_tensors,
    write_gptq,
)

# NOTE: tiny tensors: one torch thread is up to 10x faster on the shared machine (conftest)
pytestmark = pytest.mark.usefixtures("one_thread")

Writer = Callable[[Path, Path], tuple[Path, dict[str, Any]]]
# case -> (writer, formats the quantized weights are held in ("f32": dequantized), engine run)
CASES: dict[str, tuple[Writer, set[str], bool]] = {
    "ct-w4a16-group-asym": (lambda f, t: write_compressed_tensors(
        f, t, bits=4, strategy="group", group=32, symmetric=False), {"int4-g32-asym"}, True),
    "ct-w4a16-channel-sym": (lambda f, t: write_compressed_tensors(
        f, t, bits=4, strategy="channel", group=None, symmetric=True),
        {"int4-g64-sym", "int4-g96-sym"}, False),
    "ct-w8a16-channel-sym": (lambda f, t: write_compressed_tensors(
        f, t, bits=8, strategy="channel", group=None, symmetric=True), {"int8-ch"}, False),
    "ct-w8a16-group-asym": (lambda f, t: write_compressed_tensors(
        f, t, bits=8, strategy="group", group=32, symmetric=False), {"f32"}, False),
    "gptq-4bit-g32-sym-actorder": (lambda f, t: write_gptq(
        f, t, bits=4, group=32, sym=True, act_order=True), {"int4-g32-sym-perm"}, True),
    # down_proj's K = 96: its second group of 64 is partial
    "gptq-4bit-g64-asym": (lambda f, t: write_gptq(
        f, t, bits=4, group=64, sym=False, act_order=False), {"int4-g64-asym"}, False),
    "gptq-8bit-channel-sym": (lambda f, t: write_gptq(
        f, t, bits=8, group=-1, sym=True, act_order=False), {"int8-ch"}, False),
    "awq-4bit-g32": (lambda f, t: write_awq(f, t, group=32, coarse=False), {"int4-g32-asym"},
                     True),
}


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer_dir: Path
            ) -> Callable[[str], tuple[Path, dict[str, Any]]]:
    """Each case's checkpoint, written once per module."""
    cache: dict[str, tuple[Path, dict[str, Any]]] = {}

    def get(case: str) -> tuple[Path, dict[str, Any]]:
        if case not in cache:
            cache[case] = CASES[case][0](tmp_path_factory.mktemp("prequant") / case,
                                         smollm2_tokenizer_dir)
        return cache[case]

    return get


def held_format(t: HeldTensor) -> str:
    return "f32" if isinstance(t, torch.Tensor) else t.format


def dequantized(t: HeldTensor) -> torch.Tensor:
    return t if isinstance(t, torch.Tensor) else t.dequantize(torch.float32)


@pytest.mark.parametrize("case", list(CASES))
def test_held_as_stored_equals_the_writers_dequantization(
        written: Callable[[str], tuple[Path, dict[str, Any]]], case: str) -> None:
    folder, refs = written(case)
    loaded = load_model(folder, dtype=torch.float32, weights="as-stored")
    assert {held_format(loaded.weights[n]) for n in refs} == CASES[case][1]
    assert len(refs) == 14  # q, k, v, o, gate, up, down of 2 layers
    rounded = 0
    for name, ref in refs.items():
        w = dequantized(loaded.weights[name])
        if isinstance(ref, torch.Tensor):  # compressed-tensors' decompress (bf16)
            assert torch.equal(w.to(torch.bfloat16), ref), name
            continue
        assert isinstance(ref, Quantized)
        exact = ref.reference()
        diff = (w.double() - exact).abs()
        if case.startswith("awq"):  # f16 scales: a min -s * z may be rounded to f16 once
            bound = 2.0**-11 * (ref.s.double() * ref.z)[:, ref.g_idx].abs()
            assert bool((diff <= bound).all()), name
            rounded += int((diff > 0).sum())
        else:
            assert torch.equal(w.double(), exact), name
    assert rounded > 0 if case.startswith("awq") else rounded == 0  # the bound is not vacuous


def test_awq_writer_agrees_with_compressed_tensors_awq_reader(
        written: Callable[[str], tuple[Path, dict[str, Any]]]) -> None:
    """The AWQ files written from the spec read back, through compressed-tensors' own AutoAWQ
    converter, to the codes and zero points the writer quantized (the test writer is right)."""
    from compressed_tensors.entrypoints.convert.converters.autoawq import AutoAWQConverter
    from safetensors.torch import load_file

    folder, refs = written("awq-4bit-g32")
    tensors = load_file(str(folder / "model.safetensors"))
    for name, ref in refs.items():
        p = name.removesuffix(".weight")
        q, z = AutoAWQConverter.unpack_awq(tensors[p + ".qweight"], tensors[p + ".qzeros"], 4)
        q, z = AutoAWQConverter.reverse_awq_order(q, z, 4)
        assert z is not None
        assert torch.equal((q.to(torch.int64) & 15).T, ref.q), name
        assert torch.equal((z.to(torch.int64) & 15).T, ref.z), name
        assert torch.equal(tensors[p + ".scales"].T, ref.s), name


@pytest.mark.parametrize("case", [c for c, (_, _, run) in CASES.items() if run])
def test_engine_plan_and_greedy_tokens_match_transformers(
        written: Callable[[str], tuple[Path, dict[str, Any]]], case: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    folder, refs = written(case)
    engine = check(folder, "as-stored", capsys)  # plan's weight bytes == the engine's storages
    modules = list(engine.runner.model.modules())
    packed = {m.packed.format for m in modules if isinstance(m, PackedLinear)}
    assert packed == {f.removesuffix("-perm") for f in CASES[case][1]}
    permuted = [m for m in modules if isinstance(m, InputPermutedLinear)]
    assert len(permuted) == (14 if "actorder" in case else 0)  # the gather runs (not undone)
    ref_weights = {n: r.reference() if isinstance(r, Quantized) else r for n, r in refs.items()}
    hf = reference_model(folder, ref_weights)
    gen = torch.Generator().manual_seed(7)
    ids = [torch.randint(3, 300, (n,), generator=gen).tolist() for n in (5, 9, 17, 3, 12, 30)]
    result = compare(engine, hf, ids, EXACT_TOL)
    print(f"{case}: {result}")


def test_act_order_dequantizes_to_the_unpermuted_weight(
        written: Callable[[str], tuple[Path, dict[str, Any]]]) -> None:
    folder, refs = written("gptq-4bit-g32-sym-actorder")
    stored = load_model(folder, dtype=torch.float32, weights="as-stored")
    name = "model.layers.0.mlp.down_proj.weight"
    held = stored.weights[name]
    assert isinstance(held, InputPermutedWeight)
    assert not torch.equal(held.perm, torch.arange(held.perm.numel()))
    # the packed codes are the stored columns sorted by group: W[:, perm] exactly
    assert torch.equal(held.inner.dequantize(torch.float32).double(),
                       refs[name].reference()[:, held.perm])
    dense = load_model(folder, dtype=torch.float32)  # no --weights: dequantized to f32
    assert torch.equal(dense.weights[name].double(), refs[name].reference())
    rtn = load_model(folder, dtype=torch.float32, weights="int4")  # re-held by RTN at load
    assert held_format(rtn.weights[name]) == "int4-g32-asym"


@pytest.mark.parametrize(("part", "message"), [
    ("qzeros", r"q_proj\.qzeros missing \(gptq int4 g64 asym\)"),
    ("qweight", r"q_proj\.qweight missing"),
])
def test_a_missing_part_is_refused_naming_it(
        written: Callable[[str], tuple[Path, dict[str, Any]]], tmp_path: Path, part: str,
        message: str) -> None:
    from safetensors.torch import load_file, save_file

    folder, _ = written("gptq-4bit-g64-asym")
    tensors = load_file(str(folder / "model.safetensors"))
    tensors.pop(f"model.layers.1.self_attn.q_proj.{part}")
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in folder.iterdir():
        if f.suffix != ".safetensors":
            (broken / f.name).write_bytes(f.read_bytes())
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=message):
        load_model(broken, weights="as-stored")
