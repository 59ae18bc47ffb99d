"""Energy per token = power / throughput, across batch sizes.

NOTE: the device's power limit is used at every batch size. A lightly loaded GPU draws less, so
batch-1 figures are upper bounds; the best-batch figure is closer to what is drawn.
"""

from __future__ import annotations

from dataclasses import dataclass

from fitserve.ledger.speed import StepTime


@dataclass(frozen=True)
class EnergyPoint:
    batch: int
    tokens_per_s: float
    watts: float
    joules_per_token: float


def energy_per_token(watts: float, tokens_per_s: float) -> float:
    """J/token = W / (tokens/s)."""
    return watts / tokens_per_s


def energy_curve(steps: list[StepTime], power_w: float, num_devices: int) -> list[EnergyPoint]:
    """J/token for each decode step, with ``num_devices`` x ``power_w`` drawn."""
    watts = power_w * num_devices
    return [EnergyPoint(s.batch, s.tokens_per_s, watts, energy_per_token(watts, s.tokens_per_s))
            for s in steps]


def best_point(points: list[EnergyPoint]) -> EnergyPoint:
    return min(points, key=lambda p: p.joules_per_token)
