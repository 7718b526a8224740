"""fxpar.cost: pure cost functions (no process-group calls): comm, compute, memory, pipeline."""
