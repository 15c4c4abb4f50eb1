"""A synthetic long-range task: recall a passkey seen early, at the very end (`--synthetic-task passkey`).

One sample of S tokens (S + 1 drawn, as GPTDataset draws them; tokens = [:-1], labels = [1:])::

    position   0 ........ k   k+1 .. k+K ........................ S-K   S-K+1 .. S
    token      filler ... KEY d1 ... dK  filler .................. QUERY d1 ..... dK
                              \\__________ key __________________________/ answer

Filler is random, the key's K digits are random and its start k is random in [S/4, S/2 - K);
the loss mask is 1 only on the K answer tokens. Digit i is written with its own 10 token ids,
so one attention layer suffices to look the key up, but only by attending back ~S/2 tokens:
the answer (last chunk) and the key sit on different CP ranks for CP = 2 under both layouts
(zigzag: key in chunk 1 of 4 on rank 1, answer in chunk 3 on rank 0; contiguous: key on
rank 0, answer on rank 1), so the answer loss falls below ln 10 only if attention crosses
CP shards. Samples depend on (seed, index) alone, so every rank and grid sees the same ones.
"""

import numpy as np
import torch

FILLER = 32  # filler ids 0..31
KEY, QUERY = FILLER, FILLER + 1
DIGITS = FILLER + 2  # digit d of key slot i is DIGITS + 10 * i + d


class PasskeyDataset:
    """`depth` (evaluation): the key starts at that fraction of the room before the query (0: the
    first token, 1: just before the query) instead of training's random start in [S/4, S/2 - K)."""

    def __init__(self, seq_length: int, num_samples: int, seed: int, key_length: int = 4, depth: float = None):
        if seq_length // 2 - key_length - 1 <= seq_length // 4:
            raise ValueError(f"--seq-length {seq_length} is too short for a {key_length}-digit passkey; use >= 32")
        self.seq_length, self.num_samples, self.seed, self.key_length = seq_length, num_samples, seed, key_length
        self.depth = depth
        self.vocab_size = DIGITS + 10 * key_length

    def __len__(self):
        return self.num_samples

    def __getitem__(self, index: int) -> dict:
        s, k_len = self.seq_length, self.key_length
        rng = np.random.default_rng([self.seed, index])
        text = rng.integers(0, FILLER, size=s + 1)
        key = DIGITS + 10 * np.arange(k_len) + rng.integers(0, 10, size=k_len)
        start = int(rng.integers(s // 4, s // 2 - k_len))
        if self.depth is not None:
            start = min(max(int(round(self.depth * (s - 2 * k_len - 2))), 0), s - 2 * k_len - 2)
        text[start], text[start + 1 : start + 1 + k_len] = KEY, key
        text[s - k_len], text[s - k_len + 1 :] = QUERY, key
        text = torch.from_numpy(text)
        loss_mask = torch.zeros(s, dtype=torch.float32)
        loss_mask[s - k_len :] = 1.0
        return {"tokens": text[:-1], "labels": text[1:], "loss_mask": loss_mask, "position_ids": torch.arange(s)}
