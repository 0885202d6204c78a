"""Room on disk for the next checkpoint: leftovers of dead saves, and ``keep`` applied early.

Before a save writes anything, rank 0 (the checkpoint folder is shared by every rank)
calls :func:`make_room`:

1. **Leftovers of saves that are certainly dead go.** A save writes into
   ``step_N.tmp-<token>`` (and, replacing a checkpoint of the same step, moves the old
   one aside to ``step_N.old-<token>``); ``token`` is drawn once per run, so every
   attempt under ``torchrun --max-restarts`` has its own. A leftover is dead when it is
   this run's own (its previous save has returned: it failed and could not clean up) or
   when nothing in it was modified since this run started, by the filesystem's clock
   (:func:`filesystem_now`, read when the writer is made). A run that crashed did so
   before this one started; a save of another job still running in the same folder keeps
   writing, so its folder stays newer than this run and is left alone. A ``.old-`` folder
   is only removed when the checkpoint that replaced it is complete (a save killed
   between its two renames leaves the only copy there).
2. **``keep`` applies before the write when the disk is short.** When this save would
   take the folder past ``checkpoint.keep`` checkpoints, the oldest ones are removed
   after it anyway; if the free space (``shutil.disk_usage``) is less than the save needs,
   they are removed first, oldest first, one at a time until it fits, never the one
   ``latest`` names. Each removal is logged.
3. If it still does not fit, the save is refused before any rank writes a byte: one line
   with the sizes, and every checkpoint (and ``latest``) as it was.

What the save needs is summed from every rank's file sizes, known before writing
(tensor bytes plus headers), each rounded up to the filesystem's block, plus the index
(an allowance per piece) and the ``latest`` pointer.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

from .format import INDEX
from .reader import complete_checkpoints, read_latest

# index.json: the fields rank 0 records (config, model identity, trainer state) plus a
# piece's JSON per tensor file entry (~200-300 bytes indented; 512 leaves room) and the
# file records
INDEX_BYTES_PER_PIECE = 512
INDEX_BYTES_BASE = 4 << 10


def filesystem_now(root: Path) -> float:
    """The time now by the clock of the filesystem holding ``root`` (a shared filesystem's
    server may not agree with this host's clock): the modification time of a file made
    and removed here. This host's clock when ``root`` does not exist (then no leftover
    can be older than this run) or cannot be written."""
    if root.is_dir():
        probe = root / f".clock-{os.getpid()}-{time.monotonic_ns()}"
        try:
            fd = os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
            try:
                return os.fstat(fd).st_mtime
            finally:
                os.close(fd)
                os.unlink(probe)
        except OSError:
            pass
    return time.time()


def _newest_mtime(folder: Path) -> float:
    newest = folder.stat().st_mtime
    for entry in os.scandir(folder):
        try:
            newest = max(newest, entry.stat(follow_symlinks=False).st_mtime)
        except FileNotFoundError:
            pass
    return newest


def leftover_kind(name: str) -> tuple[str, str, str] | None:
    """``(step folder, kind, token)`` of a save's leftover folder name, else None:
    ``step_00000012.tmp-ab12`` is ``("step_00000012", "tmp", "ab12")``."""
    if not name.startswith("step_"):
        return None
    for kind in ("tmp", "old"):
        final, sep, token = name.partition(f".{kind}-")
        if sep and token:
            return final, kind, token
    return None


def dead_leftovers(root: Path, token: str, started: float) -> list[Path]:
    """Leftover folders under ``root`` that no live save can be using (module docstring)."""
    out = []
    if not root.is_dir():
        return out
    for p in sorted(root.iterdir()):
        kind = leftover_kind(p.name)
        if kind is None or not p.is_dir() or p.is_symlink():
            continue
        final, what, owner = kind
        if what == "old" and not (root / final / INDEX).is_file():
            continue  # the only copy of a checkpoint whose replacement never finished
        try:
            dead = owner == token or _newest_mtime(p) < started
        except FileNotFoundError:  # removed by its owner meanwhile
            continue
        if dead:
            out.append(p)
    return out


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def needed_bytes(root: Path, rank_files: list[list[int]], pieces: int, fields_bytes: int) -> int:
    """Bytes a checkpoint takes: every rank's file sizes rounded up to the filesystem's
    block, the index (``fields_bytes`` of rank 0's fields, an allowance per piece and per
    file) and the ``latest`` pointer."""
    block = max(1, os.statvfs(root).f_frsize)
    total = 0
    for sizes in rank_files:
        total += sum(-(-n // block) * block for n in sizes)
    files = sum(len(sizes) for sizes in rank_files)
    index = INDEX_BYTES_BASE + fields_bytes + INDEX_BYTES_PER_PIECE * (pieces + files)
    return total + -(-index // block) * block + block


def make_room(root: Path, step: int, need: int, keep: int, token: str, started: float,
              log=print) -> str | None:
    """Clear dead leftovers and, if the disk is short, the checkpoints ``keep`` would drop
    after this save; returns None when ``need`` bytes fit, else the refusal (one line)."""
    root.mkdir(parents=True, exist_ok=True)
    for p in dead_leftovers(root, token, started):
        shutil.rmtree(p, ignore_errors=True)
        log(f"checkpoint: removed {p.name}, left by a save that did not finish")
    free = shutil.disk_usage(root).free
    if free >= need:
        return None
    latest = read_latest(root)
    others = [p for s, p in complete_checkpoints(root) if s != step]
    # after this save there are len(others) + 1; keep-N then drops the oldest beyond keep
    doomed = others[:max(0, len(others) + 1 - keep)] if keep > 0 else []
    for path in doomed:
        if free >= need:
            break
        if latest is not None and path.resolve() == latest.resolve():
            continue
        shutil.rmtree(path, ignore_errors=True)
        after = shutil.disk_usage(root).free
        log(f"checkpoint: removed {path.name} before saving step {step} (checkpoint.keep={keep}): "
            f"{_size(free)} free of the {_size(need)} the save needs, {_size(after)} after")
        free = after
    if free >= need:
        return None
    kept = ", ".join(p.name for _, p in complete_checkpoints(root)) or "none"
    return (f"no room for checkpoint step {step} in {root}: it needs {_size(need)}, "
            f"{_size(free)} is free (kept: {kept}; checkpoint.keep={keep or 'all'}); "
            "free space there, set checkpoint.dir to a larger filesystem, or lower checkpoint.keep")
