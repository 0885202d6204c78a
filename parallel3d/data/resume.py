"""``prepare-data`` resumed after an interruption, from its last finished shard.

Each time a shard is finished, the run saves ``OUT/.prepare-state.json`` (atomically):
how many units of work (tasks, :mod:`parallel3d.data.sources`) are written, every
writer's finished shards and how many tokens of its partial shard belong to those tasks
(:meth:`~parallel3d.data.format.ShardWriter.state`), the documents and bytes counted, and
the options and inputs it was made for (file names, sizes, modification times, the
tokenizer's sha256, shard size, validation share, text key, format).

A rerun with the same options and inputs, into an ``--out`` without ``index.json``,
finds the state, keeps the finished shards as they are, cuts each partial shard back to
the saved length, and starts at the first task not written; the tasks before it are read
again (cheap: the raw lines or rows) but not tokenized. Everything after is written as
an uninterrupted run writes it, so the result is the same byte for byte. Other options or
inputs start over (and say why). The state is deleted once ``index.json`` is written.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from parallel3d.data.format import atomic_write_bytes

STATE = ".prepare-state.json"


def options_key(files: list[Path], tokenizer_sha256: str, **options) -> dict:
    """What a saved state must match to be resumed."""
    inputs = []
    for f in files:
        st = f.stat()
        inputs.append([str(f.resolve()), st.st_size, st.st_mtime_ns])
    return {"inputs": inputs, "tokenizer": tokenizer_sha256, **options}


def load_state(out: Path, key: dict) -> tuple[dict | None, str]:
    """(the saved state, "") when it matches ``key``; else (None, why not: "" when there
    is none)."""
    path = out / STATE
    if not path.is_file():
        return None, ""
    try:
        state = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None, f"{path} cannot be read"
    if state.get("key") != key:
        old = state.get("key") or {}
        differ = [k for k in sorted(set(old) | set(key)) if old.get(k) != key.get(k)]
        return None, f"the interrupted run had other {', '.join(differ) or 'options'}"
    return state, ""


def kept_files(state: dict | None) -> set[str]:
    """The files of ``out`` a resume keeps: finished shards and partial ones."""
    if state is None:
        return set()
    keep = set()
    for split in state["writers"].values():
        for name, w in split.items():
            if isinstance(w, dict) and "shards" in w:
                keep.update(s["file"] for s in w["shards"])
                keep.add(f".{w['name']}-{len(w['shards']):05d}.bin.partial")
                keep.add(f"{w['name']}-{len(w['shards']):05d}.bin")  # finished after the state
    return keep


class StateSaver:
    """Called after every task; saves the state when a shard was finished since the last
    save. ``writers`` are prepare's per-split writers (tokens, starts, mask)."""

    def __init__(self, out: Path, key: dict, writers: dict):
        self.out, self.key, self.writers = out, key, writers
        self._shards = self._finished()

    def _finished(self) -> int:
        return sum(len(w.shards) for sw in self.writers.values() for w in sw.parts())

    def __call__(self, tasks_done: int, counters: dict) -> None:
        finished = self._finished()
        if finished == self._shards:
            return
        self._shards = finished
        writers = {split: {name: {**w.state(), "name": w.name} for name, w in sw.named_parts()}
                   | {"supervised": sw.supervised}
                   for split, sw in self.writers.items()}
        state = {"key": self.key, "tasks_done": tasks_done, **counters, "writers": writers}
        atomic_write_bytes(self.out / STATE, json.dumps(state).encode())


def restore_writers(writers: dict, state: dict) -> None:
    for split, sw in writers.items():
        saved = state["writers"][split]
        for name, w in sw.named_parts():
            w.restore(saved[name])
        sw.supervised = saved["supervised"]


def clear_state(out: Path) -> None:
    try:
        os.unlink(out / STATE)
    except FileNotFoundError:
        pass
