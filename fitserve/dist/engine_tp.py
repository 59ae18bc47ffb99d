"""The engine's side of tensor parallelism: start the group, build rank 0's shard, and a
runner that sends each step's plan to the workers before running its own shard."""

from __future__ import annotations

import os

import torch

from fitserve.config import EngineConfig, ModelSpec
from fitserve.dist.comm import CollectiveError, OpCount
from fitserve.dist.group import TPGroup, launched_externally
from fitserve.dist.layout import check_tp_layout, rank_spec
from fitserve.dist.shard import row_parallel_groups
from fitserve.dist.tp_model import TPCausalLM, build_tp_model
from fitserve.ledger.parallel import tp_step_collectives
from fitserve.loading import LoadedModel
from fitserve.runner.model_runner import ModelRunner, logits_rows
from fitserve.sampling import RequestSamplingState
from fitserve.types import RunnerOutput, SchedulerOutput


def check_tp_config(cfg: EngineConfig, loaded: LoadedModel, device: torch.device) -> None:
    """Everything that makes --tp N impossible, before any process starts (ValueError)."""
    tp = cfg.tensor_parallel_size
    if device.type != "cpu":
        raise ValueError(f"tensor parallelism runs on the CPU (gloo) here, not on {device}")
    spec = loaded.spec
    if spec.rope_scaling is not None and spec.rope_scaling.kind == "longrope":
        raise ValueError("tensor parallelism with LongRoPE (Phi-3 long context) is not supported: "
                         "the worker ranks do not see prompt lengths, which pick the rotary rows")
    check_tp_layout(spec, tp, group_sizes=row_parallel_groups(loaded.weights),
                    expert_group_sizes=row_parallel_groups(loaded.weights, routed_experts=True))


def start_tensor_parallel(cfg: EngineConfig, loaded: LoadedModel, *, dtype: torch.dtype,
                          device: torch.device, max_positions: int
                          ) -> tuple[TPGroup, TPCausalLM, ModelSpec]:
    """Spawn (or join) the group and build rank 0's shard: (group, model, rank 0's spec)."""
    tp = cfg.tensor_parallel_size
    check_tp_config(cfg, loaded, device)
    if launched_externally(tp) and int(os.environ["RANK"]) != 0:
        # under torchrun, a rank > 0 becomes a worker inside the Engine constructor
        from fitserve.dist.worker import run_worker

        raise SystemExit(run_worker(cfg, int(os.environ["RANK"]), tp, "env://"))
    group = TPGroup(cfg, tp, str(loaded.path))
    try:
        model = build_tp_model(loaded.spec, loaded.weights, tp=tp, rank=0, comm=group.comm,
                               dtype=dtype, device=device, max_positions=max_positions)
    except Exception:
        group.kill()
        raise
    return group, model, rank_spec(loaded.spec, tp, 0)


class TPModelRunner(ModelRunner):
    """Rank 0's runner: broadcasts the step's plan, then runs its shard like any runner (the
    model's collectives meet the workers'; its logits come back whole from the gather).

    It also adds up what the planner's ledger (plan.parallel.tp_step_collectives) says each
    step's collectives are, so the measured counters can be printed beside it.
    """

    group: TPGroup
    full_spec: ModelSpec
    ledger: dict[str, OpCount]

    def attach(self, group: TPGroup, full_spec: ModelSpec, act_dtype: torch.dtype) -> None:
        self.group, self.full_spec, self.ledger = group, full_spec, {}
        self.act_bytes = torch.finfo(act_dtype).bits // 8

    def execute(self, out: SchedulerOutput, states: dict[str, RequestSamplingState]
                ) -> RunnerOutput:
        self._add_to_ledger(out)
        try:
            self.group.send_step(out)
            return super().execute(out, states)
        except CollectiveError:
            self.group.kill()  # the group is broken: no step can run again
            raise

    def _add_to_ledger(self, out: SchedulerOutput) -> None:
        rows, _, verify = logits_rows(out.chunks)
        for line in tp_step_collectives(
                self.full_spec, tp=self.group.tp, tokens=sum(len(c.token_ids) for c in out.chunks),
                logits_rows=len(rows) + sum(c.num_draft + 1 for c, _ in verify),
                act_dtype_bytes=self.act_bytes):
            c = self.ledger.setdefault(line.kind, OpCount())
            c.calls += line.calls
            c.bytes += line.calls * line.bytes_per_call


def collectives_table(runner: TPModelRunner, generated_tokens: int) -> str:
    """Measured collectives (rank 0's counters) beside the ledger's, per kind and per token."""
    rows = [f"{'collective':<22}{'calls':>9}{'ledger':>9}{'MiB':>10}{'ledger':>10}"
            f"{'calls/token':>13}"]
    measured = runner.group.comm.counts
    for kind in sorted(set(measured) | set(runner.ledger)):
        m = measured.get(kind, OpCount())
        led = runner.ledger.get(kind)
        per_tok = m.calls / generated_tokens if generated_tokens else 0.0
        rows.append(f"{kind:<22}{m.calls:>9}{'-' if led is None else led.calls:>9}"
                    f"{m.bytes / 2**20:>10.3f}"
                    f"{'-' if led is None else f'{led.bytes / 2**20:.3f}':>10}{per_tok:>13.1f}")
    rows.append(f"time in collectives on rank 0: {runner.group.comm.seconds:.3f} s")
    return "\n".join(rows)
