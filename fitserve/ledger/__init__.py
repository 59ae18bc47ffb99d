"""The torch-free accounting the engine sizes itself with and the planner reports: weight and KV
formats, parameters, FLOPs, memory in the order an engine reserves it, scratch, runtime baseline,
step time, hardware, parallel layouts and collectives. Nothing here imports torch."""
