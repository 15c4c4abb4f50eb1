"""Variable-length samples for dynamic context parallelism: one whole document per sample.

A fixed-length sample (megatron's ``GPTDataset``) cuts the token stream into ``--seq-length`` pieces, so a
long document is spread over several samples and short ones are packed together. Dynamic CP sizes each
document's CP group by its own length, so here a sample *is* a document of a Megatron indexed dataset
(PREFIX.bin/.idx, one ``add_document`` per document):

    sample i  ->  tokens = doc[:L], labels = doc[1:L + 1], loss_mask (0 on EOD inputs with --eod-mask-loss)
                  L = min(len(doc) - 1, --seq-length): a longer document is cut at --seq-length

Which documents: the split's share of every --data-path prefix (megatron's ``--split`` rule, each prefix's
documents rounded as ``BlendedMegatronDatasetBuilder`` rounds them), concatenated, documents of fewer than
2 tokens left out; in an order drawn from ``--data-seed``, a new one each pass (epoch) over them. The order
and the lengths depend only on the files, the seed and the sample index: every rank derives the same global
batch, and a resumed run continues with the same samples (`cp_ext.training.dynamic_batches`).
"""

from typing import List, Sequence

import numpy as np
import torch

from cp_ext.errors import ConfigError


class DocumentSamples:
    """``len(ds)`` samples, ``ds.length(i)`` (tokens of sample i, read from the index only) and ``ds[i]``."""

    def __init__(self, prefixes: Sequence[str], split_bounds, seq_length: int, seed: int, num_samples: int,
                 eod=None, eod_mask_loss: bool = False, vocab_size: int = None):
        from megatron.core.datasets.indexed_dataset import IndexedDataset

        self.seq_length, self.seed, self._len = seq_length, seed, num_samples
        self.eod, self.eod_mask_loss, self.vocab_size = eod, eod_mask_loss, vocab_size
        self.datasets: List = []
        entries = []  # (dataset index, document index, length in tokens)
        for d, prefix in enumerate(prefixes):
            data = IndexedDataset(prefix)
            self.datasets.append(data)
            n = len(data)
            first, end = int(round(split_bounds[0] * n)), int(round(split_bounds[1] * n))
            sizes = np.asarray(data.sequence_lengths[first:end], dtype=np.int64)
            keep = np.nonzero(sizes >= 2)[0]
            entries.append(np.stack([np.full(keep.size, d), first + keep, sizes[keep]], axis=1))
        self.documents = np.concatenate(entries) if entries else np.zeros((0, 3), np.int64)
        if len(self.documents) == 0:
            raise ConfigError(f"--dynamic-context-parallel: the split holds no document of 2 or more tokens in "
                              f"{' '.join(prefixes)}; give it a larger --split share or other --data-path files")
        self._orders = {}

    def __len__(self) -> int:
        return self._len

    @property
    def distinct_samples(self) -> int:
        return len(self.documents)

    def _document(self, index: int) -> np.ndarray:
        """The row (dataset, document, length) of sample ``index``: pass ``index // n`` in its own order."""
        n = len(self.documents)
        epoch, within = divmod(int(index), n)
        order = self._orders.get(epoch)
        if order is None:
            order = np.random.RandomState((self.seed + 7919 * epoch) % 2**32).permutation(n)
            self._orders = {epoch: order}  # one pass at a time is enough: batches read forward
        return self.documents[order[within]]

    def length(self, index: int) -> int:
        """The tokens sample ``index`` trains on (its inputs): min(document - 1, --seq-length)."""
        return int(min(self._document(index)[2] - 1, self.seq_length))

    def __getitem__(self, index: int) -> dict:
        d, doc, size = (int(x) for x in self._document(index))
        n = min(size - 1, self.seq_length)
        ids = torch.from_numpy(self.datasets[d].get(doc, offset=0, length=n + 1).astype(np.int64))
        tokens, labels = ids[:-1], ids[1:]
        loss_mask = torch.ones(n, dtype=torch.float32)
        if self.eod_mask_loss and self.eod is not None:
            loss_mask[tokens == self.eod] = 0.0
        return {"tokens": tokens, "labels": labels, "loss_mask": loss_mask}
