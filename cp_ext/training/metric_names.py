"""The names runs log their metrics under (metrics.jsonl, wandb, TensorBoard), in one place: the
trainer writes them and the loss-curve comparison (`cp_ext.compare.curves`, `cp_ext.compare.report`) reads
them. No torch: a tool reading logs imports only this."""

METRIC_KEYS = {
    "lm loss": "train/lm_loss",
    "load balancing loss": "train/load_balancing_loss",
    "grad norm": "train/grad_norm",
    "learning rate": "train/learning_rate",
}
DYNAMIC_CP_PREFIX = "dynamic cp "
LM_KEY = METRIC_KEYS["lm loss"]
AUX_KEY = METRIC_KEYS["load balancing loss"]


def metric_key(name):
    """The metrics.jsonl / wandb key of a trainer metric: the fixed ones, and every MoE loss
    megatron's router tracks (``z loss`` -> ``train/z_loss``, ``seq load balancing loss``, ...)."""
    if name in METRIC_KEYS:
        return METRIC_KEYS[name]
    if name.startswith(DYNAMIC_CP_PREFIX):  # dynamic CP's plan (`cp_ext.training.dynamic_batches.StepPlan.metrics`)
        return "train/" + name.replace("/", " over ").replace(" ", "_")
    return "train/" + name.replace(" ", "_") if name.endswith(" loss") else None
