"""Tokenizers, as megatron-core's datasets expect them (its `MegatronTokenizerBase` interface).

    --tokenizer-type ByteTokenizer          UTF-8 bytes 0..255, EOD = 256 (vocab 257); no files
    --tokenizer-type HuggingFaceTokenizer   any HuggingFace `tokenizers` JSON file
        --tokenizer-model tokenizer.json    (EOD = its </s>, <|endoftext|>, <eos> ... token, or
                                            one id past the vocab when it has none)

`build_tokenizer(args)` is the one place the flags become a tokenizer; preprocessing and
the loader both call it, so the ids on disk and the model's vocab agree.
"""

import os
from collections import OrderedDict

import numpy as np

# The base megatron.core.datasets types its tokenizer against on every supported release (0.16.1's
# `datasets.megatron_tokenizer.MegatronLegacyTokenizer` is gone from 0.17); the datasets read
# `vocab_size` and `eod`, preprocessing `tokenize`.
from megatron.core.tokenizers import MegatronTokenizerBase

TOKENIZER_TYPES = ("ByteTokenizer", "HuggingFaceTokenizer")
_EOD_NAMES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "[SEP]", "<eod>")


class _Tokenizer(MegatronTokenizerBase):
    """What the two tokenizers share: the identity megatron's datasets hash, and no chat template
    (pretraining data is plain text)."""

    def __init__(self, path):
        super().__init__(path, config={})
        # megatron's datasets put this in the description their index caches are named by; the legacy
        # base's form, so caches built on any supported release stay valid on the others
        self.unique_identifiers = OrderedDict(**{"class": type(self).__name__, "tokenizer_path": [path]})

    def apply_chat_template(self, *args, **kwargs):
        raise NotImplementedError(f"{type(self).__name__} has no chat template (cp_ext pretrains on plain text)")


class ByteTokenizer(_Tokenizer):
    """Bytes as tokens; id 256 ends a document."""

    def __init__(self):
        super().__init__("ByteTokenizer")

    def tokenize(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def detokenize(self, ids) -> str:
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")

    @property
    def vocab_size(self):
        return 257

    @property
    def vocab(self):
        return {**{chr(i): i for i in range(256)}, "<eod>": 256}

    @property
    def inv_vocab(self):
        return {v: k for k, v in self.vocab.items()}

    @property
    def eod(self):
        return 256


class HuggingFaceTokenizer(_Tokenizer):
    """A HuggingFace `tokenizers` JSON file (tokenizer.json), without transformers."""

    def __init__(self, path: str):
        from tokenizers import Tokenizer

        super().__init__(os.path.abspath(path))
        try:
            self._tok = Tokenizer.from_file(path)
        except Exception as e:  # the library raises bare Exceptions for a bad file
            raise ValueError(f"--tokenizer-model {path}: not a HuggingFace tokenizers JSON file ({e})") from e
        self._vocab = self._tok.get_vocab(with_added_tokens=True)
        named = [self._vocab[n] for n in _EOD_NAMES if n in self._vocab]
        self._size = max(self._vocab.values()) + 1
        self._eod = named[0] if named else self._size
        self._size = max(self._size, self._eod + 1)

    def tokenize(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.int32)

    def detokenize(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids])

    @property
    def vocab_size(self):
        return self._size

    @property
    def vocab(self):
        return self._vocab

    @property
    def inv_vocab(self):
        return {v: k for k, v in self._vocab.items()}

    @property
    def eod(self):
        return self._eod


def build_tokenizer(tokenizer_type: str, tokenizer_model: str = None):
    """The tokenizer named by --tokenizer-type / --tokenizer-model (ValueError naming the flag)."""
    if tokenizer_type == "ByteTokenizer":
        return ByteTokenizer()
    if tokenizer_type == "HuggingFaceTokenizer":
        if not tokenizer_model:
            raise ValueError("--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model PATH/tokenizer.json")
        if os.path.isdir(tokenizer_model):  # Megatron-LM's habit: a Hugging Face model directory
            inside = os.path.join(tokenizer_model, "tokenizer.json")
            if not os.path.isfile(inside):
                raise ValueError(f"--tokenizer-model {tokenizer_model}: a directory without tokenizer.json (cp_ext "
                                 f"reads Hugging Face's fast-tokenizer file; save the tokenizer with transformers' "
                                 f"save_pretrained, which writes it)")
            tokenizer_model = inside
        if not os.path.isfile(tokenizer_model):
            raise ValueError(f"--tokenizer-model {tokenizer_model}: no such file")
        return HuggingFaceTokenizer(tokenizer_model)
    raise ValueError(f"--tokenizer-type {tokenizer_type}: choose one of {', '.join(TOKENIZER_TYPES)}")
