"""What calibration measured of one linear layer's inputs: shared by the calibration pass that
collects it and the AWQ / GPTQ transforms that read it."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class LinearStats:
    """What one linear layer's input ``x [rows, K]`` looked like on the calibration set."""

    hessian: torch.Tensor  # float64 [K, K], sum of x^T x over calibration rows
    rows: int
    abs_mean: torch.Tensor  # float32 [K] mean |x| per input channel
    sample: torch.Tensor  # float32 [S, K], a deterministic subsample of input rows
