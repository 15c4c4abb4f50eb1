"""A Hugging Face model directory, read lazily: ``config.json`` and its safetensors tensors by name."""

import json
from pathlib import Path

import torch

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


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
        self.files = self._files()
        self._open = {}

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
        return set(self.files)

    def get(self, name, shape=None) -> torch.Tensor:
        """The tensor ``name`` in fp32; ``shape``: what config.json implies it must be."""
        from safetensors import safe_open

        if name not in self.files:
            raise HFError(f"--hf-dir {self.dir}: tensor {name} is missing (the mapping needs it)")
        path = self.files[name]
        try:
            if path not in self._open:
                self._open = {path: safe_open(path, "pt")}  # one shard open at a time
            tensor = self._open[path].get_tensor(name)
        except HFError:
            raise
        except Exception as e:
            raise HFError(f"{path}: tensor {name} cannot be read ({type(e).__name__}: {e}); the file is corrupt "
                          f"or truncated") from None
        if shape is not None and tuple(tensor.shape) != tuple(shape):
            raise HFError(f"{path}: tensor {name} has shape {tuple(tensor.shape)}, config.json implies {tuple(shape)}")
        return tensor.float()
