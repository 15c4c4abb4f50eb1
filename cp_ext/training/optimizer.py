"""megatron-core's optimizer (Adam, weight decay, gradient clipping) and its LR schedule
(linear warmup, then cosine/linear decay to --min-lr), built from the arguments."""

from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler


def build_optimizer(args, config, model_chunks):
    """Returns (optimizer, scheduler); without apex/TE megatron falls back to torch's Adam."""
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=args.lr,
            min_lr=args.min_lr,
            weight_decay=args.weight_decay,
            adam_beta1=args.adam_beta1,
            adam_beta2=args.adam_beta2,
            adam_eps=args.adam_eps,
            clip_grad=args.clip_grad,
            bf16=args.bf16,
            params_dtype=config.params_dtype,
            use_distributed_optimizer=args.use_distributed_optimizer,
        ),
        model_chunks,
    )
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if args.lr_warmup_iters else args.lr,
        max_lr=args.lr,
        min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_iters,
        lr_decay_steps=args.lr_decay_iters,
        lr_decay_style=args.lr_decay_style,
        start_wd=args.weight_decay,
        end_wd=args.weight_decay,
        wd_incr_steps=args.lr_decay_iters,  # unused by the constant style; not a second source of mismatch
        wd_incr_style="constant",
        # Megatron-LM's resume semantics (checked at parse time against meta.json)
        override_opt_param_scheduler=args.override_opt_param_scheduler,
        use_checkpoint_opt_param_scheduler=args.use_checkpoint_opt_param_scheduler,
    )
    return optimizer, scheduler
