"""cp_ext's modules for megatron-core's transformer layer spec: norms and core attention."""
