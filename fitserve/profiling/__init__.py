"""Profiling with hard numbers: ``fitserve profile`` and the measured step-time model.

- :mod:`fitserve.profiling.workloads`: named workloads (W1, W2, custom) and the offline driver
  that times every token of every request on an :class:`fitserve.engine.Engine`;
- :mod:`fitserve.profiling.trace`: a torch.profiler window of steps (Chrome/Perfetto trace,
  per-op and per-input-shape tables);
- :mod:`fitserve.profiling.report`: percentiles, the per-shape step table, utilisation, the
  summary JSON and the printed tables;
- :mod:`fitserve.profiling.sweep` and :mod:`fitserve.profiling.calibrate`: the sweep of step
  shapes that fits :class:`fitserve.plan.step_time.StepTimeModel` on this machine, saved under
  ``$FITSERVE_HOME/step-models``;
- :mod:`fitserve.profiling.cli_profile`: the ``fitserve profile`` command.

Importing this package imports nothing heavy (no torch); the modules import what they need.
"""
