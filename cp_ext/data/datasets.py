"""Which dataset a run trains on, from its arguments.

Today: the embedded default (`cp_ext.data.embedded`). A dataset here is a sequence of
samples: ``len(ds)``, ``ds[i]`` -> int64 array of ``seq_length + 1`` token ids, and
``ds.vocab_size``.
"""

from cp_ext.data.embedded import EmbeddedTextDataset


def build_train_dataset(args):
    return EmbeddedTextDataset(args.seq_length)
