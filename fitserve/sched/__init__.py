"""Token-budget scheduler with chunked prefill and preemption by recompute. Torch-free."""

from fitserve.sched.request import SchedRequest
from fitserve.sched.scheduler import Scheduler

__all__ = ["SchedRequest", "Scheduler"]
