"""Shared fixtures: a per-module pool of gloo worker processes and a small cached corpus."""

from __future__ import annotations

import pytest

from parallel3d.testing import ProcessGroupPool


@pytest.fixture(scope="module")
def pools():
    """``pools(n)`` gives this module's pool of ``n`` gloo ranks, started on first use."""
    started: dict[int, ProcessGroupPool] = {}

    def get(world_size: int) -> ProcessGroupPool:
        if world_size not in started:
            started[world_size] = ProcessGroupPool(world_size)
        return started[world_size]

    yield get
    for pool in started.values():
        pool.close()


@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory):
    """A tokenized corpus (1 MB of the stdlib, BPE vocab 512) built once per session."""
    from parallel3d.config import DataConfig
    from parallel3d.train.data import prepare_corpus

    cache = tmp_path_factory.mktemp("corpus")
    prepare_corpus(DataConfig(max_bytes=1_000_000, vocab_size=512, cache_dir=str(cache)))
    return str(cache)
