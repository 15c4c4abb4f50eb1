"""A Hugging Face model directory, read lazily: ``config.json`` and its safetensors tensors by name.

A quantized release (config.json's ``quantization_config``: `cp_ext.hf.quantized.METHODS`) reads as its unquantized
twin: `HFCheckpoint.names` gives the logical names (``X`` for ``X`` + ``X_scale_inv``, ``X.weight`` for
DeepSeek-V4's ``X.weight`` + ``X.scale``, ``Y`` for ``Y_blocks`` + ``Y_scales``) and `HFCheckpoint.get`
dequantizes, so an adapter never knows.
"""

import json
from pathlib import Path

import torch

from cp_ext.hf import quantized as q

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
_FLOAT_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64"}  # safetensors' names


class HFError(ValueError):
    """A bad Hugging Face directory or tensor: the message names the file, the key and what was expected."""


class HFCheckpoint:
    def __init__(self, directory):
        self.dir = Path(directory)
        config = self.dir / "config.json"
        if not config.is_file():
            raise HFError(f"--hf-dir {self.dir}: no config.json (a Hugging Face model directory has one)")
        try:
            self.config = json.loads(config.read_text())
        except json.JSONDecodeError as e:
            raise HFError(f"{config}: not JSON ({e})") from None
        self.quantization, self.block = self._quantization(config)  # config: the path, for messages
        self.files = self._files()  # stored names
        self._open = {}
        self.parts = self._logical()  # {logical name: the stored names it is read from}

    def _quantization(self, config):
        """(quant_method or None, fp8's weight_block_size or None)."""
        qc = self.config.get("quantization_config")
        if qc is None:
            return None, None
        method = qc.get("quant_method") if isinstance(qc, dict) else None
        if method not in q.METHODS:
            supported = ", ".join(f"{m!r} ({what})" for m, what in q.METHODS.items())
            raise HFError(f"{config}: quantization_config's quant_method {method!r} is not supported; supported: "
                          f"{supported}")
        if method == "mxfp4":
            return method, None
        block = qc.get("weight_block_size", [128, 128])  # transformers' FineGrainedFP8Config default; null: per tensor
        if block is not None and not (isinstance(block, list) and len(block) == 2
                                      and all(isinstance(b, int) and b > 0 for b in block)):
            raise HFError(f"{config}: quantization_config's weight_block_size {block!r} is not two positive integers")
        return method, tuple(block) if block else None

    def _logical(self):
        """Each logical tensor's stored names: (X,) as stored; (X, X_scale_inv) FP8; (Y_blocks, Y_scales) MXFP4.
        Only the method config.json names pairs tensors up: elsewhere a name ending in _scales is just a name."""
        stored, parts = set(self.files), {}
        for name in sorted(stored):
            if self.quantization == "fp8" and name.endswith(q.SCALE_INV):
                base = name[:-len(q.SCALE_INV)]
                if base not in stored:
                    raise HFError(f"{self.files[name]}: tensor {name} scales {base}, which the checkpoint lacks")
                parts[base] = (base, name)
            if self.quantization == "fp8" and name.endswith(q.V4_SCALE):  # DeepSeek-V4's X.weight + X.scale
                base = name[:-len(q.V4_SCALE)] + q.WEIGHT
                if base in stored:
                    parts[base] = (base, name)
            for have, other in ((q.BLOCKS, q.SCALES), (q.SCALES, q.BLOCKS)):
                if self.quantization == "mxfp4" and name.endswith(have):
                    base = name[:-len(have)]
                    if base + other not in stored:
                        raise HFError(f"{self.files[name]}: tensor {name} has no {base + other} (MXFP4 stores {base} "
                                      f"as {base + q.BLOCKS} and {base + q.SCALES})")
                    if base in stored:
                        raise HFError(f"--hf-dir {self.dir}: both {base} and its MXFP4 {base + have} are stored")
                    parts[base] = (base + q.BLOCKS, base + q.SCALES)
        partners = {p for pair in parts.values() for p in pair}
        return {**{name: (name,) for name in stored - partners}, **parts}

    def _files(self):
        """{tensor name: the safetensors file holding it}."""
        from safetensors import safe_open

        index = self.dir / INDEX
        if index.is_file():
            weight_map = json.loads(index.read_text()).get("weight_map", {})
            for shard in sorted(set(weight_map.values())):
                if not (self.dir / shard).is_file():
                    raise HFError(f"{index} names the shard {shard}, which is not in {self.dir}")
            return {name: self.dir / shard for name, shard in weight_map.items()}
        single = self.dir / SINGLE
        if not single.is_file():
            raise HFError(f"--hf-dir {self.dir}: neither {INDEX} nor {SINGLE}")
        try:
            with safe_open(single, "pt") as f:
                return {name: single for name in f.keys()}
        except Exception as e:  # safetensors' own error for a truncated or corrupt header
            raise HFError(f"{single}: not a readable safetensors file: corrupt or truncated ({type(e).__name__}: {e})") from None

    def names(self):
        """The logical tensor names: a quantized tensor's partners are hidden behind it."""
        return set(self.parts)

    def get(self, name, shape=None) -> torch.Tensor:
        """The tensor ``name`` in its stored dtype (fp32 if dequantized; the checkpoint writer casts to the model's),
        a copy: safetensors hands out views of its mapped file, which would keep each shard mapped (and resident)
        for as long as any tensor read from it lives. ``shape``: what config.json implies it
        must be (checked on the dequantized tensor)."""
        if name not in self.parts:
            raise HFError(f"--hf-dir {self.dir}: tensor {name} is missing (the mapping needs it)")
        parts = self.parts[name]
        path = self.files[parts[0]]
        tensors = [self._read(p) for p in parts]  # each read opens its shard: a partner may live in another one
        if len(parts) == 1:
            tensor, how = tensors[0], ""
            if tensor.dtype == q.FP8:
                raise HFError(f"{path}: tensor {name} is stored in float8_e4m3fn, but there is no "
                              f"{name + q.SCALE_INV} to scale it by" + ("" if self.quantization == "fp8" else
                              f" (and config.json's quant_method is {self.quantization}, not 'fp8')"))
        else:
            how = f" (dequantized from {' and '.join(parts)})"
            fp4 = self.quantization == "fp8" and tensors[0].dtype == q.FP4_PACKED  # DeepSeek-V4's experts
            want = ((q.FP4_PACKED if fp4 else q.FP8, None) if self.quantization == "fp8"
                    else (torch.uint8, torch.uint8))
            for part, t, dtype in zip(parts, tensors, want):
                if dtype is not None and t.dtype != dtype:
                    fp4_too = f" (or, FP4-packed, in {q.FP4_PACKED})" if self.quantization == "fp8" else ""
                    raise HFError(f"{self.files[part]}: tensor {part} is stored in {t.dtype}; {self.quantization} "
                                  f"stores it in {dtype}{fp4_too}")
            try:
                if fp4:
                    tensor = q.dequantize_fp4_rows(*tensors)
                elif self.quantization == "fp8":
                    tensor = q.dequantize_fp8_blocks(*tensors, self.block)
                else:
                    tensor = q.dequantize_mxfp4(*tensors)
            except ValueError as e:
                raise HFError(f"{self.files[parts[1]]}: tensor {parts[1]} does not fit {parts[0]}: {e}") from None
        if shape is not None and tuple(tensor.shape) != tuple(shape):
            raise HFError(f"{path}: tensor {name}{how} has shape {tuple(tensor.shape)}, config.json implies "
                          f"{tuple(shape)}")
        return tensor.clone() if len(parts) == 1 else tensor

    def shapes_only(self):
        """This checkpoint, with `get` checking names and shapes from the safetensors headers and returning
        meta tensors: the whole mapping is checked (missing, left-over, misshapen) before any data is read."""
        return _ShapesOnly(self)

    def stored_shape(self, name):
        """The logical (dequantized) shape of ``name``, from the headers alone."""
        from safetensors import safe_open

        parts = self.parts[name]
        try:
            with safe_open(self.files[parts[0]], "pt") as f:
                stored = f.get_slice(parts[0])
                shape, dtype = tuple(stored.get_shape()), stored.get_dtype()
        except Exception as e:
            raise HFError(f"{self.files[parts[0]]}: not a readable safetensors file: corrupt or truncated "
                          f"({type(e).__name__}: {e})") from None
        if len(parts) == 2 and self.quantization == "mxfp4":  # blocks [..., rows, G, 16] -> [..., G * 32, rows]
            shape = (*shape[:-3], shape[-2] * 2 * shape[-1], shape[-3])
        if len(parts) == 2 and self.quantization == "fp8" and dtype == "I8":  # FP4: two columns a byte
            shape = (*shape[:-1], 2 * shape[-1])
        return shape

    def stored_dtypes(self):
        """{logical name: its stored dtype's torch name ("bfloat16", "float32", ...)}, from the headers alone; a
        dequantized tensor (two parts, or stored in another dtype) has none: its export is the unquantized twin."""
        from safetensors import safe_open

        out = {}
        for path in sorted(set(self.files.values())):
            with safe_open(path, "pt") as f:
                for name in f.keys():
                    dtype = _FLOAT_DTYPES.get(f.get_slice(name).get_dtype())
                    if dtype is not None and self.parts.get(name) == (name,):
                        out[name] = dtype
        return out

    def _read(self, name):
        """The stored tensor ``name`` as stored."""
        from safetensors import safe_open

        path = self.files[name]
        try:
            if path not in self._open:
                self._open = {path: safe_open(path, "pt")}  # one shard open at a time
            return self._open[path].get_tensor(name)
        except Exception as e:
            raise HFError(f"{path}: tensor {name} cannot be read ({type(e).__name__}: {e}); the file is corrupt "
                          f"or truncated") from None


class _ShapesOnly:
    def __init__(self, hf):
        self.hf, self.dir, self.config = hf, hf.dir, hf.config

    def names(self):
        return self.hf.names()

    def get(self, name, shape=None):
        if name not in self.hf.parts:
            raise HFError(f"--hf-dir {self.dir}: tensor {name} is missing (the mapping needs it)")
        stored = self.hf.stored_shape(name)
        if shape is not None and stored != tuple(shape):
            how = f" (dequantized from {' and '.join(self.hf.parts[name])})" if len(self.hf.parts[name]) == 2 else ""
            raise HFError(f"{self.hf.files[self.hf.parts[name][0]]}: tensor {name}{how} has shape {stored}, "
                          f"config.json implies {tuple(shape)}")
        return torch.empty(stored, device="meta")
