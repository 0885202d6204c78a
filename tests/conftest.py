"""Shared fixtures: a per-module pool of gloo worker processes and a small cached corpus;
DeepSpeed's CPU Adam op built in the background from the start of the session."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from parallel3d.testing import ProcessGroupPool

from helpers import POOL_START, torch_threads


@pytest.fixture(scope="module")
def one_thread():
    """Compute in the test process on one thread (a module opts in with
    ``pytestmark = pytest.mark.usefixtures("one_thread")``): the pool's ranks take the other
    core, and two OpenMP threads spinning on a loaded 2-core machine turn a 20 ms step into
    seconds."""
    with torch_threads(1):
        yield


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


@pytest.fixture(scope="session")
def chat_data(tmp_path_factory):
    """Chat data made by prepare-data --format chat: 120 conversations, a ChatML tokenizer
    (vocabulary below 640); packed whole by default, so documents restart their positions
    inside a window and only assistant turns are trained on."""
    from chat_inputs import make_chat_tokenizer, make_conversations, write_jsonl
    from parallel3d.data.prepare import prepare_data

    root = tmp_path_factory.mktemp("chat")
    tok = make_chat_tokenizer(root / "tok", "chatml")
    write_jsonl(root / "in" / "chats.jsonl", make_conversations(120, seed=1))
    prepare_data([str(root / "in")], tok, root / "data", workers=1, progress=False, format="chat")
    return str(root / "data")


# -- DeepSpeed's CPU Adam, built while the other tests run -----------------------------------

_CPU_ADAM_BUILD = pytest.StashKey[subprocess.Popen]()


def pytest_collection_finish(session):
    """When a selected test needs the cpu_adam op (the ``cpu_adam_built`` fixture), start
    its JIT build now, at the lowest CPU priority: on a new machine it takes ~50 s of two
    cores (g++ on DeepSpeed's sources), which this way come out of the time the suite
    leaves a core idle (single-process tests, sleeps) instead of being waited for. Where
    the op is built already, the process only loads it."""
    if session.config.option.collectonly or not any(
            "cpu_adam_built" in getattr(item, "fixturenames", ()) for item in session.items):
        return
    code = "from parallel3d.zero.adam import load_cpu_adam; load_cpu_adam()"
    session.config.stash[_CPU_ADAM_BUILD] = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True, preexec_fn=lambda: os.nice(19))


@pytest.fixture(scope="session")
def cpu_adam_built(request):
    """DeepSpeed's ``DeepSpeedCPUAdam`` class, its op built: the background build waited
    for, then loaded here (a build that failed in the background fails here again, with
    load_cpu_adam's one-line error)."""
    from parallel3d.zero.adam import load_cpu_adam

    build = request.config.stash.get(_CPU_ADAM_BUILD, None)
    if build is not None:
        build.wait()
    return load_cpu_adam()


def pytest_sessionfinish(session):
    """A session that ends before the build does (-x, ^C) stops it with SIGINT, so that
    torch's build lock is released (a SIGKILLed build leaves it, and every later build
    waits on it forever)."""
    build = session.config.stash.get(_CPU_ADAM_BUILD, None)
    if build is None or build.poll() is not None:
        return
    os.killpg(build.pid, signal.SIGINT)
    try:
        build.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(build.pid, signal.SIGKILL)
        build.wait()
