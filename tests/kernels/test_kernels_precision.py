"""Precision: a bf16 running sum stalls at 256; every kernel accumulates in fp32."""

from __future__ import annotations

import math

import torch

from fitserve.tools.labs.online_softmax import ACC_DTYPE, OnlineSoftmax
from fitserve.tools.labs.paged import paged_attention_reference
from fitserve.tools.labs.rmsnorm import rms_norm_one_pass
from fitserve.tools.labs.split_kv import split_kv_decode
from fitserve.tools.labs.tiled import tiled_attention


def test_bf16_running_sum_stalls_at_256() -> None:
    """bf16 has 8 significant bits: above 256 the spacing is 2 and 256 + 1 rounds back (ties to
    even) to 256, forever."""
    s_bf = torch.zeros((), dtype=torch.bfloat16)
    s_fp = torch.zeros((), dtype=torch.float32)
    for _ in range(1000):
        s_bf = s_bf + 1.0
        s_fp = s_fp + 1.0
    assert float(s_bf) == 256.0
    assert float(s_fp) == 1000.0


def test_online_softmax_state_is_fp32() -> None:
    assert torch.float32 == ACC_DTYPE
    st = OnlineSoftmax((2, 3), 4)
    st.update(torch.zeros(2, 3, 5), torch.ones(5, 4, dtype=torch.bfloat16))
    assert st.m.dtype == st.l.dtype == st.acc.dtype == torch.float32


def test_tiled_lse_over_1000_equal_keys_is_not_stalled() -> None:
    """1000 keys with equal scores: l = 1000 exactly. A bf16 running sum would give log(256)."""
    q = torch.zeros(1, 1, 8, dtype=torch.bfloat16)
    k = torch.randn(1, 1000, 8).bfloat16()
    v = torch.arange(1000, dtype=torch.float32).view(1, 1000, 1).bfloat16()
    out, lse = tiled_attention(q, k, v, block_m=1, block_n=1)      # 1000 one-key tiles
    assert lse.dtype == torch.float32
    assert abs(float(lse) - math.log(1000)) < 1e-5
    mean_v = float(v.float().mean())
    assert abs(float(out) - mean_v) <= mean_v * 2 ** -8           # one bf16 rounding of O


def test_split_kv_and_paged_accumulate_in_fp32() -> None:
    q = torch.zeros(1, 1, 4, dtype=torch.bfloat16)
    k = torch.randn(1, 3000, 1, 4).bfloat16()
    v = torch.ones(1, 3000, 1, 4, dtype=torch.bfloat16)
    out, lse = split_kv_decode(q, k, v, torch.tensor([3000]), num_splits=3, block_n=1)
    assert abs(float(lse) - math.log(3000)) < 1e-4 and torch.all(out == 1)
    kc = k.view(3000, 1, 1, 4)
    table = torch.arange(3000, dtype=torch.int32).view(1, 3000)
    o2, lse2 = paged_attention_reference(q, kc, kc.clone().fill_(1), table, torch.tensor([3000]),
                               torch.tensor([0, 1]), scale=1.0, block_n=1, return_lse=True)
    assert abs(float(lse2) - math.log(3000)) < 1e-4 and torch.all(o2 == 1)


def test_rmsnorm_sum_of_squares_not_stalled() -> None:
    x = torch.ones(1, 4096, dtype=torch.bfloat16)
    w = torch.ones(4096, dtype=torch.bfloat16)
    assert torch.all(rms_norm_one_pass(x, w, eps=0.0) == 1)
    # a bf16 running sum of squares would stop at 256 -> rms 0.25 -> y = 4
    acc = torch.zeros((), dtype=torch.bfloat16)
    for val in x[0, :600]:
        acc = acc + val * val
    assert float(acc) == 256.0
