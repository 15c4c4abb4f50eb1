"""Performance accounting shared by the tools: communication bytes (counted at the call
sites and by formula) and per-rank memory formulas.

* `cp_ext.perf.counter`: the opt-in byte counter the attention call sites report to;
* `cp_ext.perf.comm`: the formulas for bytes sent per rank by the ring, Ulysses, TP and EP;
* `cp_ext.perf.memory`: parameter counts and per-rank memory (weights, grads, optimizer,
  activations, attention state) used by ``tools/plan_parallelism.py``.

Pure Python (no torch import) so the planner runs anywhere.
"""
