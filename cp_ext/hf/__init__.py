"""Hugging Face checkpoints in and out of cp_ext (`tools/convert_hf.py`).

`reader.HFCheckpoint` reads ``config.json`` and the safetensors (sharded with an index, or one file),
tensor by tensor, and dequantizes a quantized release's tensors (`quantized`: DeepSeek-V3's
block-scaled FP8, GPT-OSS's MXFP4 experts) so that they read as the unquantized release's;
`families` holds one adapter per architecture: the config's flags, and how each of megatron's full
(unsharded) tensors is assembled from Hugging Face's. No transformers needed.
"""
