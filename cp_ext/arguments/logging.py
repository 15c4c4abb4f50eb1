"""Logging flags: the run directory (metrics.jsonl, config.yaml) and wandb."""


def add_logging_args(parser):
    g = parser.add_argument_group("logging")
    g.add_argument("--log-dir", default=None,
                   help="run directory for metrics.jsonl and config.yaml (default runs/<exp name or time>)")
    g.add_argument("--wandb-project", default=None, help="log to wandb (WANDB_MODE=offline/disabled respected)")
    g.add_argument("--wandb-exp-name", default=None, help="wandb run name; also names the default --log-dir")
    g.add_argument("--wandb-save-dir", default=None, help="wandb's directory (default: the run directory)")
    g.add_argument("--wandb-entity", default=None)

