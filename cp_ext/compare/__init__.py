"""The loss-curve comparison (``cp-ext-compare``, ``tools/compare_loss_curves.py``): two runs' curves,
read and judged iteration by iteration. No torch, no megatron-core: reading logs stays light.

    curves.py  reading metrics.jsonl / wandb runs, aligning and judging the curves (`ToleranceBand`)
    report.py  the text, JSON and plot of a comparison
"""
