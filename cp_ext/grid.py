"""The parallel grid: TP x PP x CP x DP ranks (EP and expert-TP folded into DP x CP, as megatron-core
folds them), and CP split into Ulysses x ring. One description, used by the trainer to build the
process groups, by checkpoints to record where they were saved, and by the planner to rank layouts.

Importing this module imports neither torch nor megatron-core (the planner and the parse-time
checks read it); `Grid.initialize` builds the groups with megatron's ``parallel_state`` and
`cp_ext.parallel_state`'s Ulysses and ring sub-groups.
"""

from dataclasses import asdict, dataclass
from datetime import timedelta

# Each of Grid's sizes and the flag (its Megatron-LM dest) that sets it; data parallelism is what is left.
GRID_FLAGS = {"tp": "tensor_model_parallel_size", "pp": "pipeline_model_parallel_size", "cp": "context_parallel_size",
              "ep": "expert_model_parallel_size", "etp": "expert_tensor_parallel_size", "ulysses": "ulysses_size"}


@dataclass(frozen=True)
class Grid:
    """The sizes of one grid. ``dp`` is what the world leaves: world = tp x pp x cp x dp."""

    tp: int = 1
    pp: int = 1
    cp: int = 1
    dp: int = 1
    ep: int = 1
    etp: int = 1
    ulysses: int = 1

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    @classmethod
    def from_args(cls, args, world_size=None) -> "Grid":
        """The grid of parsed (validated) arguments, on ``world_size`` ranks (default: the run's)."""
        sizes = {field: getattr(args, name) for field, name in GRID_FLAGS.items()}
        world = world_size if world_size is not None else args.world_size
        return cls(dp=world // (sizes["tp"] * sizes["pp"] * sizes["cp"]), **sizes)

    @classmethod
    def problems_of(cls, args) -> list:
        """`problems` of the grid the flags in ``args`` ask for, on the run's ``args.world_size`` ranks."""
        return cls.from_args(args).problems(args.world_size)

    def problems(self, world_size: int) -> list:
        """What keeps this grid's sizes from tiling ``world_size`` ranks, each naming the flags and the
        fix (Megatron-LM's rules: TP x PP x CP divides the world, and so does expert-TP x EP x PP). The
        rules that involve the model (heads, layers, vocabulary over TP and PP) or the CP flags
        (--ulysses-size, --cp-comm-type) are the arguments' (`cp_ext.arguments.parallel`)."""
        p = []
        model_parallel = self.tp * self.pp * self.cp
        if world_size % model_parallel:
            p.append(f"world size {world_size} is not divisible by --tensor-model-parallel-size ({self.tp}) x "
                     f"--pipeline-model-parallel-size ({self.pp}) x --context-parallel-size ({self.cp}) = "
                     f"{model_parallel}; launch a multiple of {model_parallel} ranks or change the sizes")
        elif world_size % (self.etp * self.ep * self.pp):
            p.append(f"world size {world_size} is not divisible by --expert-tensor-parallel-size ({self.etp}) x "
                     f"--expert-model-parallel-size ({self.ep}) x --pipeline-model-parallel-size ({self.pp}); "
                     f"change the expert sizes")
        return p

    def as_meta(self) -> dict:
        """The sizes by flag (Megatron-LM's dests), as a checkpoint's meta.json records them."""
        sizes = asdict(self)
        return {name: sizes[field] for field, name in GRID_FLAGS.items()}

    def initialize(self, timeout_minutes: float = 10) -> None:
        """Build this grid's process groups (collective): megatron's, then the Ulysses and ring sub-groups.

        ``timeout_minutes`` (Megatron-LM's --distributed-timeout-minutes) reaches every group: a stopped
        or hung rank makes the others fail with a message, not wait for megatron's default half hour.
        A grid already in place with the same sizes and timeout is kept (tests and tools build many
        trainers in one process; new groups each time would pile up gloo threads); another one is left
        first (`destroy`)."""
        import torch.distributed as dist
        from megatron.core import parallel_state as mpu

        from cp_ext import parallel_state as cp_state

        if dist.get_world_size() != self.world:
            raise ValueError(f"the grid {self} needs {self.world} ranks; this job has {dist.get_world_size()}")
        key = (self, timeout_minutes)
        if cp_state.initialized_grid() == key:
            return
        if mpu.model_parallel_is_initialized():
            self.destroy()
        mpu.initialize_model_parallel(
            tensor_model_parallel_size=self.tp, pipeline_model_parallel_size=self.pp,
            context_parallel_size=self.cp, expert_model_parallel_size=self.ep,
            expert_tensor_parallel_size=self.etp, distributed_timeout_minutes=timeout_minutes,
        )
        cp_state.initialize_context_parallel(self.ulysses, timeout=timedelta(minutes=timeout_minutes), grid=key)

    @staticmethod
    def destroy() -> None:
        """Leave the grid in place, keeping the world group (`cp_ext.parallel_state.destroy_grid`)."""
        from cp_ext import parallel_state as cp_state

        cp_state.destroy_grid()


def initialize_distributed(args, device) -> Grid:
    """Start a run's ranks: torch.distributed, then the grid in ``args`` (`Grid.initialize`: one already in
    place with the same sizes is kept), then the seeds megatron's model construction reads. Returns the
    grid. The trainer, generation, HF conversion and the tools all start here."""
    import torch
    import torch.distributed as dist
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from cp_ext.platform import distributed_backend

    if not dist.is_initialized():
        # --distributed-timeout-minutes reaches the world group too (and every grid group: `Grid.initialize`)
        dist.init_process_group(backend=distributed_backend(device),
                                timeout=timedelta(minutes=args.distributed_timeout_minutes))
    grid = Grid.from_args(args, world_size=dist.get_world_size())
    grid.initialize(args.distributed_timeout_minutes)
    torch.manual_seed(args.seed)
    model_parallel_cuda_manual_seed(args.seed)
    return grid
