"""Tensor parallelism on torch.distributed (gloo on CPU, NCCL on CUDA).

layout.py (which rank holds which heads, rows and vocabulary; torch-free) -> shard.py (slices
the loaded weights) -> tp_model.py (the collectives in the decoder) -> comm.py (counted,
watched collectives) -> step_message.py (a step's plan as one int64 tensor) -> worker.py /
group.py (the processes) -> tp_runner.py (rank 0's runner). ring.py simulates ring
all-reduce index arithmetic for the planner.
"""
