"""Shared fixtures: a per-module pool of gloo worker processes and a small cached corpus."""

from __future__ import annotations

import pytest
import torch

from parallel3d.testing import ProcessGroupPool

from helpers import POOL_START


@pytest.fixture(scope="module")
def one_thread():
    """Compute in the test process on one thread (a module opts in with
    ``pytestmark = pytest.mark.usefixtures("one_thread")``): the pool's ranks take the other
    core, and two OpenMP threads spinning on a loaded 2-core machine turn a 20 ms step into
    seconds."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def pools():
    """``pools(n)`` gives this module's pool of ``n`` gloo ranks, started on first use."""
    started: dict[int, ProcessGroupPool] = {}

    def get(world_size: int) -> ProcessGroupPool:
        if world_size not in started:
            started[world_size] = ProcessGroupPool(world_size, start_method=POOL_START)
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


@pytest.fixture(scope="session")
def prepared_dir(tmp_path_factory):
    """A dataset made by prepare-data: ~1 MB of mixed text / JSON lines, a BPE of 700
    tokens (EOS id 2), 5% of the documents held out, shards of 20k tokens."""
    from data_inputs import make_mixed_inputs, make_tokenizer
    from parallel3d.data.prepare import prepare_data

    root = tmp_path_factory.mktemp("prepared")
    tok = make_tokenizer(root / "tok")
    make_mixed_inputs(root / "in", 1_000_000)
    prepare_data([str(root / "in")], tok, root / "data", workers=1, val_fraction=0.05,
                 shard_tokens=20_000, progress=False)
    return str(root / "data")

