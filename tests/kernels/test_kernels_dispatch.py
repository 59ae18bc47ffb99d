"""The dispatch rule: classification and the implementation per shape class."""

from __future__ import annotations

from fitserve.kernels.dispatch import (
    IMPLS,
    ShapeClass,
    choose_attention_impl,
    choose_library_kernel,
    classify,
)


def test_classify() -> None:
    assert classify("cpu", [1, 1], [100, 5000]) == ShapeClass("cpu", "decode", "small",
                                                              "very_long")
    assert classify("cpu", [7], [7]) == ShapeClass("cpu", "prefill", "1", "short")
    assert classify("cuda", [1] * 32, [600] * 32, triton=True).batch_bucket == "large"


def test_cpu_rule() -> None:
    assert choose_attention_impl(classify("cpu", [256], [256])) == "naive"
    assert choose_attention_impl(classify("cpu", [1024], [1024])) == "sdpa"
    assert choose_attention_impl(classify("cpu", [1] * 32, [2048] * 32)) == "naive"
    assert choose_attention_impl(classify("cpu", [1], [8192])) == "sdpa"


def test_cuda_uses_triton_when_available() -> None:
    assert choose_attention_impl(classify("cuda", [1], [8192], triton=True)) == "triton_decode"
    assert choose_attention_impl(classify("cuda", [64], [8192], triton=True)) == "triton_forward"
    assert choose_attention_impl(classify("cuda", [64], [8192], triton=False)) == "sdpa"


def test_every_answer_is_a_known_impl() -> None:
    for dev in ("cpu", "cuda"):
        for q in ([1], [1] * 16, [300], [3000] * 2):
            for tr in (False, True):
                sc = classify(dev, q, [max(q) * 3] * len(q), triton=tr)
                assert choose_attention_impl(sc) in IMPLS
                assert choose_library_kernel(sc) in IMPLS
