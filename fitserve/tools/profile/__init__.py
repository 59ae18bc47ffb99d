"""Profiling with hard numbers: ``fitserve profile`` and the measured step-time model.

- :mod:`fitserve.tools.profile.workloads`: named workloads (W1, W2, custom) and the offline driver
  that times every token of every request on an :class:`fitserve.engine.core.Engine`;
- :mod:`fitserve.tools.profile.trace`: a torch.profiler window of steps (Chrome/Perfetto trace,
  per-op and per-input-shape tables);
- :mod:`fitserve.tools.profile.report`: percentiles, the per-shape step table, utilisation, the
  summary JSON and the printed tables;
- :mod:`fitserve.engine.calibration_sweep` and :mod:`fitserve.engine.calibrate`: the sweep of step
  shapes that fits :class:`fitserve.ledger.step_time.StepTimeModel` on this machine, saved under
  ``$FITSERVE_HOME/step-models``;
- :mod:`fitserve.tools.profile.cli`: the ``fitserve profile`` command.

Importing this package imports nothing heavy (no torch); the modules import what they need.
"""
