"""cp_ext: exact context parallelism for long-sequence MoE training on megatron-core."""

__version__ = "0.1.0"
