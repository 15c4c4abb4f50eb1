"""The GPU check's tests: does cp_ext compute exact attention and train on this node?

``bash tools/gpu_check.sh [--out DIR]`` runs them on every GPU of a node and prints one summary
row per check (tools/gpu_check.py). They are pytest tests under the ``gpu`` marker:

    CP_EXT_GPU_CHECK_DEVICE=cpu pytest tests/gpu -q      # what a CPU can run (the default without CUDA)
    pytest tests/gpu -m gpu -q                           # on a GPU node

`pytest tests` leaves them out (tests/gpu/conftest.py): tests/tools/test_gpu_check.py runs their CPU
mode through the tool, with deliberately broken rings that must fail.

* test_one_device.py: the library's ring (`cp_ext.attention.cp.ring`) on C = 4 ranks of one device
  with every kernel that runs there x fp64/fp32/bf16/fp16 x causal/full x MHA/GQA, packed documents
  through every kernel's segments and through the ring (`ring_harness.py`);
* test_masks.py: windows, sinks and MLA's head dims through every kernel;
* test_one_gpu.py: tests/attention/kernels/test_cuda_kernels.py, and Megatron-LM's MoE scripts on one GPU;
* test_multi_gpu.py: NCCL ring / Ulysses / hybrid, a demo training, the bench's byte counts and the
  model's grid equivalence, on every GPU;
* test_linear_attention.py: fla's kernels and the state-passing CP op;
* test_deepseek_v4.py: DeepSeek-V4's sliding, CSA and HCA layers against float64.

Bounds: `tests.attention.bounds`. Rows and the verdict: `tests.gpu.rows`.
"""
