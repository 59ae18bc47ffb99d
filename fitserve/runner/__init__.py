"""The model runner: input building for a scheduled step, the eager decode loop, the compiled
decode step, lazily backed memory, and teacher-forced scoring through the paged cache."""
