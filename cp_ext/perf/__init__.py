"""Performance accounting shared by the tools: communication bytes (counted at the call
sites and by formula) and per-rank memory formulas.

* `cp_ext.perf.counter`: the opt-in byte counter the attention call sites report to;
* `cp_ext.perf.comm`: the formulas for bytes sent per rank by the ring, Ulysses, TP and EP, and by
  linear attention's CP methods (state passing, head parallelism, the hybrid, the conv halo);
* `cp_ext.perf.sent_bytes`: the bytes a run's torch.distributed calls really send, recorded by wrapping them;
* `cp_ext.perf.memory`: parameter counts and per-rank memory (weights, grads, optimizer,
  activations, attention state) used by the planner (``tools/plan_parallelism.py``);
* `cp_ext.perf.parallelism_planner`: the planner itself, ranking TP x PP x CP x DP x EP grids;
* `cp_ext.perf.saved_tensors`: measured memory, the bytes autograd saves for backward and what an
  all-gather attention call holds while it runs (``tools/measure_memory.py``);

The planner's modules (`memory`, `model_shape`) import no torch, so the planner runs anywhere
(an import-linter contract in pyproject.toml keeps them so).
"""
