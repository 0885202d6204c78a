"""Tokenized datasets: the on-disk format, ``prepare-data``, the sampler and the loader.

    format.py   flat token shards + index.json; TokenStream, open_dataset
    prepare.py  ``parallel3d prepare-data``: text / JSON lines / Parquet -> shards
    stdlib.py   the embedded default corpus, prepared into the same format
    sampler.py  TokenWindows, GlobalBatchSampler (deterministic, resumable)
    loader.py   PrefetchLoader: the next steps' batches built in a background thread

This package's ``__init__`` imports nothing, so ``prepare-data`` worker processes start
without importing torch.
"""
