"""Tokenized datasets: the on-disk format, ``prepare-data``, the sampler and the loader.

    format.py     flat token shards + index.json; TokenStream, open_dataset
    sources.py    input files (text / JSON lines / Parquet) -> units of work -> documents
    tokenizer.py  a Hugging Face tokenizer folder and its EOS token
    prepare.py    ``parallel3d prepare-data``: workers, validation split, shards, report
    chat.py       ``--format chat``: conversations, the chat template, the loss mask
    stdlib.py     the embedded default corpus, prepared into the same format
    sampler.py    TokenWindows, GlobalBatchSampler (deterministic, resumable)
    packing.py    PackedWindows: documents packed with positions and a loss mask
    batch.py      MicroBatch: inputs, targets (IGNORE_INDEX), positions, loss divisor
    loader.py     PrefetchLoader: the next steps' batches built in a background thread

This package's ``__init__`` imports nothing, so ``prepare-data`` worker processes start
without importing torch.
"""
