#!/usr/bin/env python
"""Pretrain a Mixture-of-Experts GPT with megatron-core and cp_ext.

    torchrun --nproc-per-node 4 pretrain_moe.py --config configs/cpu_demo.yaml
    torchrun ... pretrain_moe.py --config configs/X.yaml --num-layers 8   # flags override YAML

Flags use Megatron-LM's spellings; `pretrain_moe.py --help` lists them.
"""

import os
import sys
import warnings

# megatron-core warns at import that apex/TE are absent; cp_ext does not need them.
warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex).*", category=UserWarning)
# torch.distributed's renames, and a CUDA tuning hint the launch scripts already follow.
warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
warnings.filterwarnings("ignore", message=".*CUDA_DEVICE_MAX_CONNECTIONS.*")
warnings.filterwarnings("ignore", message="full scope is deprecated")  # megatron's own default
warnings.filterwarnings("ignore", message=".*ShardedTensor.*", category=FutureWarning)  # megatron's checkpoint format



def main(argv=None):
    try:
        from cp_ext.arguments import ConfigError, parse_args_or_exit, single_process_without_torchrun
    except ImportError as e:  # megatron-core missing or not the pinned version
        _fail_once(str(e), 2)
    single_process_without_torchrun()
    from cp_ext.training.signals import die_with_launcher

    die_with_launcher()  # a SIGKILLed torchrun takes its ranks with it
    args = parse_args_or_exit(argv)  # validated before any process group or model exists
    from cp_ext.checkpoint.checkpointer import CheckpointReadError, CheckpointWriteError
    from cp_ext.console import exit_with_config_error
    from cp_ext.training.trainer import Trainer

    try:
        trainer = Trainer(args)
        if args.skip_train:
            trainer.evaluate_only()
        else:
            trainer.train()
    except CheckpointReadError as e:  # every rank reads the same files: one message, from rank 0
        _fail_once(f"cannot load the checkpoint: {e}", 1)
    except CheckpointWriteError as e:  # raised on every rank alike (`Checkpointer.save`)
        _fail_once(f"cannot save the checkpoint: {e}", 1)
    except ConfigError as e:  # found once the data is open (a split too small for --eval-iters)
        exit_with_config_error("pretrain_moe.py", e)
    except Exception as e:
        from cp_ext.training.peer_failures import failure_message

        message = failure_message(e, os.environ.get("RANK", "0"), args.distributed_timeout_minutes)
        if message is None:
            raise
        # Said by every rank that met it (the failed one cannot): which rank, and what it lost.
        print(f"pretrain_moe.py: {message}", file=sys.stderr, flush=True)
        os._exit(1)  # no teardown: it would wait on the same missing rank
    trainer.shutdown()


def _fail_once(message, status):
    if os.environ.get("RANK", "0") == "0":
        print(f"pretrain_moe.py: {message}", file=sys.stderr, flush=True)
    sys.exit(status)


if __name__ == "__main__":
    main()
