"""What a run under SLURM must agree with: its job's requeue policy and its step's nodes.

- A job SLURM requeues (after a node failure, a preemption, ``scontrol requeue``) starts its batch script
  again. Without --save the new run starts over from iteration 0, and nothing says so: a requeued run
  (``SLURM_RESTART_COUNT`` >= 1) without --save, or with --save and no --load, is a configuration error; a job that may be requeued
  (``scontrol show job``: ``Requeue=1``, sbatch's ``--requeue`` or the cluster's ``JobRequeue=1``) gets one
  line on rank 0 saying so.
- One torchrun per node of the step: a step on N nodes whose torchrun sees another count of nodes
  (``--standalone`` on each node, or a wrong ``--nnodes``) runs several jobs that each think they are the
  whole run, on the same --save.
"""

import os
import shutil
import subprocess


def slurm_problems(args) -> list:
    p = []
    restarts = os.environ.get("SLURM_RESTART_COUNT", "")
    if restarts.isdigit() and int(restarts) > 0 and not args.save:
        p.append(f"this SLURM job was requeued (SLURM_RESTART_COUNT={restarts}) and has no --save: the run starts "
                 f"over from iteration 0 and what the earlier run trained is lost; give --save DIR and --load DIR "
                 f"(the same directory), or submit with sbatch's --no-requeue")
    elif restarts.isdigit() and int(restarts) > 0 and not args.load:
        p.append(f"this SLURM job was requeued (SLURM_RESTART_COUNT={restarts}) and has --save but no --load: the "
                 f"run starts over from iteration 0 and overwrites what the earlier run saved in {args.save}; give "
                 f"--load {args.save}, or submit with sbatch's --no-requeue")
    step_nodes, torchrun_nodes = os.environ.get("SLURM_STEP_NUM_NODES"), os.environ.get("GROUP_WORLD_SIZE")
    if step_nodes and torchrun_nodes and step_nodes.isdigit() and torchrun_nodes.isdigit() \
            and int(step_nodes) != int(torchrun_nodes):
        nodes = os.environ.get("SLURM_STEP_NODELIST") or os.environ.get("SLURM_JOB_NODELIST", "?")
        p.append(f"the SLURM step runs on {step_nodes} nodes ({nodes}; SLURM_STEP_NUM_NODES) but torchrun sees "
                 f"{torchrun_nodes} (GROUP_WORLD_SIZE): start one torchrun per node with --nnodes {step_nodes} and "
                 f"one rendezvous endpoint (srun --ntasks-per-node=1; scripts/slurm_multi_node.sbatch), not "
                 f"--standalone")
    return p


def requeue_warning(args):
    """The line rank 0 prints when SLURM may requeue this job but the run could not resume (no --save, or
    no --load); else None."""
    job = os.environ.get("SLURM_JOB_ID")
    if not job or (args.save and args.load) or os.environ.get("RANK", "0") != "0" \
            or shutil.which("scontrol") is None:
        return None
    try:
        shown = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    if "Requeue=1" not in shown.split():
        return None
    lacks = "no --save" if not args.save else "no --load"
    return (f"note: SLURM may requeue job {job} (Requeue=1: after a node failure, a preemption or the time-limit "
            f"warning) but this run has {lacks}, so a requeued run would start over from iteration 0; give --save "
            f"DIR --load DIR, or submit with --no-requeue")
