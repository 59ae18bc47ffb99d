"""Golden parameter counts per catalog model, derived by hand from each config."""

from __future__ import annotations

import pytest

from fitserve.ledger.params import count_params
from fitserve.tools.planner.model_source import catalog_entry, load_catalog

# name: exact total. Derivations (H hidden, I intermediate, V vocab, L layers):
GOLDEN = {
    # per layer: q 4096^2 + k,v 2 x 4096 x 1024 + o 4096^2 = 41,943,040; MLP 3 x 4096 x 14336
    # = 176,160,768; 2 norms 8,192 -> 218,112,000 x 32 = 6,979,584,000
    # + embedding and lm_head 2 x 128,256 x 4096 = 1,050,673,152 + final norm 4,096
    "Llama-3.1-8B": 8_030_261_248,
    # per layer: 8192^2 x 2 + 2 x 8192 x 1024 + 3 x 8192 x 28672 + 2 x 8192 = 872,431,616
    # x 80 = 69,794,529,280 + 2 x 128,256 x 8192 = 2,101,346,304 + 8,192
    "Llama-3.3-70B": 70_553_706_496,
    # per layer: 2 x 16384^2 + 2 x 16384 x 1024 + 3 x 16384 x 53248 + 2 x 16384
    # = 3,187,703,808 x 126 = 401,650,679,808 + 2 x 128,256 x 16384 + 16,384
    "Llama-3.1-405B": 405_853_388_800,
    # as Llama-3.1-8B's layers (218,112,000 x 32) + 2 x 32,000 x 4096 + 4,096
    "Mistral-7B-v0.1": 7_241_732_096,
    # per layer: attention 41,943,040 + router 8 x 4096 + 8 experts x 176,160,768 + norms
    # 8,192 = 1,451,270,144 x 32 = 46,440,644,608 + 2 x 32,000 x 4096 + 4,096
    "Mixtral-8x7B": 46_702_792_704,
    # per layer: q 3584^2, k,v 2 x 3584 x 512, o 3584^2, biases 3584 + 2 x 512, MLP
    # 3 x 3584 x 18944, norms 2 x 3584 = 233,057,792 x 28 + 2 x 152,064 x 3584 + 3,584
    "Qwen2.5-7B": 7_615_616_512,
    "Qwen2.5-72B": 72_706_203_648,
    # per layer: q 5120 x 8192, k,v 2 x 5120 x 1024, o 8192 x 5120, q/k norms 2 x 128,
    # MLP 3 x 5120 x 25600, norms 2 x 5120 -> 487,598,336 x 64 + 2 x 151,936 x 5120 + 5120
    "Qwen3-32B": 32_762_123_264,
    # per layer: q 3584 x 4096, k,v 2 x 3584 x 2048, o 4096 x 3584 = 44,040,192; MLP
    # 3 x 3584 x 14336 = 154,140,672; 4 norms 14,336 -> 198,195,200 x 42 = 8,324,198,400
    # + tied embedding 256,000 x 3584 = 917,504,000 (once) + 3,584
    "Gemma-2-9B": 9_241_705_984,
    "Gemma-2-27B": 27_227_128_320,
    # per layer: 2 x 5376 x 4096 + 2 x 5376 x 2048 + 3 x 5376 x 21504 + 4 norms + q/k norms
    # 2 x 128 = 412,898,560 x 62 + tied 262,208 x 5376 + 5,376 (text only, no vision tower)
    "Gemma-3-27B": 27_009_346_304,
    # per layer: attention 2 x 2880 x 4096 + 2 x 2880 x 512 + biases 4096 + 2 x 512 + 2880 +
    # sinks 64 = 26,550,144; experts 32 x 3 x 2880^2 = 796,262,400 + biases 32 x 8640;
    # router 32 x 2880 + 32; norms 5,760 -> 823,186,976 x 24 + 2 x 201,088 x 2880 + 2880
    "gpt-oss-20b": 20_914_757_184,
    "gpt-oss-120b": 116_829_156_672,
    # per layer: q 2048 x 4096, k,v 2 x 2048 x 512, o 4096 x 2048 = 18,874,368; q/k norms 2 x 128;
    # router 128 x 2048 = 262,144; 128 experts x 3 x 2048 x 768 = 603,979,776; norms 2 x 2048
    # -> 623,120,640 x 48 + 2 x 151,936 x 2048 + 2048
    "Qwen3-30B-A3B": 30_532_122_624,
    # MLA per layer: q_a 1536 x 7168, q_b 128 x 192 x 1536, kv_a 576 x 7168, kv_b 128 x 256
    # x 512, o 7168 x 16384, norms 1536 + 512 -> 187,107,328; 3 dense MLP layers 3 x 7168 x
    # 18432; 58 MoE layers: 256 routed + 1 shared experts x 3 x 7168 x 2048, router 256 x 7168
    # + bias 256; + 2 x 129,280 x 7168 + norms
    "DeepSeek-V3": 671_026_419_200,
    # per layer: 2 x 576^2 + 2 x 576 x 192 + 3 x 576 x 1536 + 2 x 576 = 3,540,096 x 30
    # = 106,202,880 + tied 49,152 x 576 = 28,311,552 + 576
    "SmolLM2-135M": 134_515_008,
}


def test_every_catalog_model_has_a_golden_count() -> None:
    assert {m["name"] for m in load_catalog()} == set(GOLDEN)


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_golden_total_and_published_size(name: str) -> None:
    e = catalog_entry(name)
    p = count_params(e.spec)
    assert p.total == GOLDEN[name]
    assert e.published_params is not None
    # Gemma-3-27B's published 27.4B includes a 0.4B vision tower the text model lacks.
    tol = 0.02 if name == "Gemma-3-27B" else 0.002
    assert p.total == pytest.approx(e.published_params, rel=tol)


def test_hand_derivations_of_two_layers() -> None:
    l8 = 4096 * 4096 * 2 + 4096 * 1024 * 2 + 3 * 4096 * 14336 + 2 * 4096
    assert l8 * 32 + 2 * 128256 * 4096 + 4096 == GOLDEN["Llama-3.1-8B"]
    mixtral = 41_943_040 + 8 * 4096 + 8 * 3 * 4096 * 14336 + 2 * 4096
    assert mixtral == 1_451_270_144
    assert mixtral * 32 + 2 * 32000 * 4096 + 4096 == GOLDEN["Mixtral-8x7B"]
    qwen3 = 2 * 5120 * 8192 + 2 * 5120 * 1024 + 2 * 128 + 3 * 5120 * 25600 + 2 * 5120
    assert qwen3 == 487_598_336
    assert qwen3 * 64 + 2 * 151936 * 5120 + 5120 == GOLDEN["Qwen3-32B"]
    mla = 1536 * 7168 + 1536 + 128 * 192 * 1536 + 576 * 7168 + 512 + 128 * 256 * 512 + 7168 * 16384
    assert mla == 187_107_328
    moe = 257 * 3 * 7168 * 2048 + 256 * 7168 + 256  # routed + shared experts, router, bias
    dsv3 = 61 * (mla + 2 * 7168) + 3 * 3 * 7168 * 18432 + 58 * moe + 2 * 129280 * 7168 + 7168
    assert dsv3 == GOLDEN["DeepSeek-V3"]
    q3moe = 2 * 2048 * 4096 + 2 * 2048 * 512 + 2 * 128 + 128 * 2048 + 128 * 3 * 2048 * 768 + 2 * 2048
    assert q3moe == 623_120_640
    assert q3moe * 48 + 2 * 151936 * 2048 + 2048 == GOLDEN["Qwen3-30B-A3B"]
    smol = 2 * 576 * 576 + 2 * 576 * 192 + 3 * 576 * 1536 + 2 * 576
    assert smol * 30 + 49152 * 576 + 576 == GOLDEN["SmolLM2-135M"]


def test_tied_embedding_is_counted_once_as_matmul() -> None:
    p = count_params(catalog_entry("SmolLM2-135M").spec)
    assert p.lookup == 0  # tied: the embedding table is the lm_head
    assert p.matmul == 30 * (2 * 576 * 576 + 2 * 576 * 192 + 3 * 576 * 1536) + 49152 * 576
    untied = count_params(catalog_entry("Llama-3.1-8B").spec)
    assert untied.lookup == 128256 * 4096


@pytest.mark.parametrize("name", ["Mixtral-8x7B", "gpt-oss-20b", "gpt-oss-120b", "DeepSeek-V3",
                                  "Qwen3-30B-A3B"])
def test_moe_active_params(name: str) -> None:
    e = catalog_entry(name)
    p = count_params(e.spec)
    assert e.published_active_params is not None
    # gpt-oss's card counts active parameters without the embedding table; the others with it.
    active = p.active_total - (p.lookup if name.startswith("gpt-oss") else 0)
    assert active == pytest.approx(e.published_active_params, rel=0.02)
    # Mixtral: attention + 2 of 8 experts: 32 x (41,943,040 + 2 x 176,160,768 + 32,768 router)
    if name == "Mixtral-8x7B":
        assert p.active_matmul == 32 * (41_943_040 + 2 * 176_160_768 + 32_768) + 32000 * 4096
