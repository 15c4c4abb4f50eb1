"""DeepSeek sparse attention (DSA, DeepSeek-V3.2) under context parallelism.

    indexer.py           the lightning indexer's exact top-k, tiled, over the CP ring or all-gather
    sparse_attention.py  each query against its own selected latent rows (MQA over MLA's latent)
    indexer_loss.py      the indexer's KL loss against the attention's own distribution
    key_block_ring.py    the key-block ring: every key of the sequence reaches each rank block by block,
                         for consumers that select their own keys per query (no dense tiles)

The dense CP exchange is `cp_ext.attention.cp`; DSA reaches every key through its own ring
(key_block_ring.py) because a query's keys are a selection, not a band.
"""
