"""Measuring tools: the logic behind ``tools/bench_*.py``, ``tools/measure_memory.py`` and the
dynamic-CP and attention-balance reports. Nothing on the training path imports this package
(an import-linter contract in pyproject.toml keeps it so): it sits above `cp_ext.training`.

    attention.py          each CP attention variant as one timed call, bytes and work counted
    dsa.py                the DSA indexer and sparse attention against dense MLA, with counted floors
    attention_balance.py  per-rank work of each layout (zigzag, contiguous) under a mask
    dynamic_cp.py         dynamic CP's schedule against a fixed CP size, counted
    memory_measure.py     a training step's measured memory per rank
    workers.py            a measurement's ranks under torchrun, each writing its JSON record
"""
