"""Writing a checkpoint: every rank its own files, rank 0 the index, atomically.

The protocol, for step ``s`` (``token`` is agreed by the ranks once per run)::

    every rank   writes rank_RRRRR.safetensors + rank_RRRRR.json into
                 ROOT/step_0000000s.tmp-<token>/, flushed and fsynced, hashing as it writes
                 (:mod:`.rank_files`, which also merges the ranks' records into the index)
    rank 0       gathers every rank's piece list and file records, checks that the pieces
                 cover every logical tensor, writes index.json (fsynced), renames the folder
                 to ROOT/step_0000000s, then rewrites ROOT/latest (temporary name + rename):
                 the pointer moves last
    every rank   returns once rank 0 says the checkpoint is complete (or raises its error)

Before any rank writes, the ranks' file sizes go to rank 0, which makes room
(:mod:`.room`: leftovers of dead saves removed, and when the disk is short the
checkpoints ``keep`` would drop after this save removed first) or refuses the save, in
one line, before a byte is written. A save that fails while writing removes its
``.tmp-`` folder (every rank its own files, rank 0 the folder) before it raises.

A process killed at any point leaves either the previous ``latest`` or the new one, each
pointing at a complete folder; a ``.tmp-`` folder is never read and a later save deletes
it once it is certainly dead (:func:`.room.dead_leftovers`). With ``async_save`` the
tensors are first copied to host memory, and a background thread does the rest (over its
own gloo group, so training collectives are not disturbed) while training continues; the
next save (or the end of training) waits for it. The copy itself runs on that thread too
(``copy_in_background``): the training thread only lists the tensors and goes on with the
next step's forward and backward, which read the weights; the optimizer's update, the
first thing to write them, waits for the copy (:meth:`CheckpointWriter.wait_copied`).
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout

from .errors import CheckpointError
from .format import LATEST, Index
from .rank_files import RankPayload, build_index, rank_file_names, rank_file_sizes, write_rank_files
from .reader import complete_checkpoints, read_latest, step_dir_name
from .room import filesystem_now, make_room, needed_bytes
from .state import Slot


def snapshot(slots: list[Slot], copy: bool) -> list[Slot]:
    """Slots whose tensors are host copies (``copy``: always, for a background writer that
    must not see the training update them), detached either way."""
    out = []
    for s in slots:
        t = s.tensor.detach()
        t = t.to("cpu", copy=True) if copy or t.device.type != "cpu" else t
        out.append(Slot(s.name, s.placement, t, s.flat))
    return out


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


# The slowest per-client write speed a save waits for (a busy network filesystem): the
# ranks wait for the largest rank's files at this speed, on top of the job's communication
# timeout, before a missing rank is named. A faster filesystem loses nothing by it; a rank
# lost mid-save is named after this wait instead of the process group's 30-minute default.
SLOWEST_WRITE_BYTES_PER_S = 20 * 2**20


@contextmanager
def patient(group, seconds: float, restore_s: float | None):
    """``group``'s timeout is ``seconds`` inside (a wait that is not communication: a slow
    rank's writes or reads), ``restore_s`` again after (None: torch's default). The
    timeout binds every operation, the send a peer posts too, so a per-call limit alone
    (``monitored_barrier``'s) does not lift it."""
    if group is None:
        yield
        return
    group.set_timeout(timedelta(seconds=seconds))
    try:
        yield
    finally:
        group.set_timeout(timedelta(seconds=restore_s) if restore_s else default_pg_timeout)


def write_wait_s(comm_timeout_s: float, largest_rank_bytes: int) -> float:
    """Seconds the ranks of a save wait for the slowest one to finish writing."""
    return comm_timeout_s + largest_rank_bytes / SLOWEST_WRITE_BYTES_PER_S


def _by_message(errors: list[str | None]) -> str:
    """The ranks' errors, one entry per distinct message: "ranks 0-3: OSError: ..."."""
    ranks: dict[str, list[int]] = {}
    for rank, err in enumerate(errors):
        if err:
            ranks.setdefault(err, []).append(rank)
    parts = []
    for err, who in ranks.items():
        span = f"rank {who[0]}" if len(who) == 1 else (
            f"ranks {who[0]}-{who[-1]}" if who[-1] - who[0] == len(who) - 1 else f"ranks {who}")
        parts.append(f"{span}: {err}")
    return "; ".join(parts)


# A test seam: called at the named points of a save; the kill-mid-save test replaces it to
# stop the process at each of them (and ``rank_files._phase``, between tensors). A no-op otherwise.
def _phase(name: str) -> None:
    pass


class CheckpointWriter:
    """Saves checkpoints under ``root`` with the protocol of the module docstring.

    ``group``: a gloo group over every rank, used only by this writer (None: one process).
    ``keep``: how many complete checkpoints to keep (0: all)."""

    def __init__(self, root: Path, rank: int, world_size: int, group=None, keep: int = 0,
                 token: str = "0", async_save: bool = False, comm_timeout_s: float = 300.0,
                 group_timeout_s: float | None = None):
        self.root, self.rank, self.world_size, self.group = Path(root), rank, world_size, group
        self.keep, self.token, self.async_save = keep, token, async_save
        self.comm_timeout_s, self.group_timeout_s = comm_timeout_s, group_timeout_s
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._copied = threading.Event()  # the background save's host copy is done
        self._copied.set()
        # When this run started by the checkpoint filesystem's clock: leftovers not
        # modified since are dead (.room). Only rank 0 clears leftovers.
        self.started = filesystem_now(self.root) if rank == 0 else 0.0
        self.log = lambda line: print(line, flush=True)

    def save(self, payload: RankPayload, copy_in_background: bool = False) -> None:
        """Write ``payload`` (this rank's part of step ``payload.step``); collective.
        ``copy_in_background`` (async saves): the payload's tensors are the training's own,
        copied to host memory by the background thread first; the caller must not change
        them before :meth:`wait_copied` returns."""
        self.wait()
        if not self.async_save:
            self._save(payload)
            return
        if copy_in_background:
            self._copied.clear()
        self._thread = threading.Thread(target=self._run, args=(payload, copy_in_background),
                                        daemon=True, name=f"p3d-checkpoint-{payload.step}")
        self._thread.start()

    def wait_copied(self) -> None:
        """Block until the background save no longer reads the training's tensors."""
        self._copied.wait()

    def _run(self, payload: RankPayload, copy: bool) -> None:
        try:
            if copy:
                try:
                    payload.slots = snapshot(payload.slots, copy=True)
                finally:
                    self._copied.set()
            self._save(payload)
        except BaseException as e:  # noqa: BLE001 - re-raised by wait() on the main thread
            self._error = e

    def wait(self) -> None:
        """Block until a background save finishes; re-raise its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    # -- the protocol ------------------------------------------------------------------------
    def _save(self, payload: RankPayload) -> None:
        final = self.root / step_dir_name(payload.step)
        tmp = self.root / f"{final.name}.tmp-{self.token}"
        wants = self._gather((rank_file_sizes(payload), len(payload.slots)))
        refused, wait_s = self._broadcast((self._room_for(payload, wants), self._write_wait_s(wants)))
        if refused:
            raise CheckpointError(refused)
        records, error = None, None
        try:
            tmp.mkdir(parents=True, exist_ok=True)
            records = write_rank_files(tmp, payload)
        except Exception as e:  # noqa: BLE001 - every rank must reach the gather below
            error = f"{type(e).__name__}: {e}"
        _phase("rank_files_written")
        self._wait_for_writers(payload.step, wait_s)
        gathered = self._gather((records, error))
        outcome = None
        if self.rank == 0:
            try:
                failed = _by_message([err for _, err in gathered])
                if failed:
                    raise CheckpointError(failed)
                index = build_index(payload.step, [rec for rec, _ in gathered], payload.index_fields)
                self._finalize(index, tmp, final)
            except Exception as e:  # noqa: BLE001 - sent to every rank
                outcome = f"checkpoint step {payload.step} in {self.root} failed: {e}"
        outcome = self._broadcast(outcome)
        if outcome:
            self._discard(tmp)
            raise CheckpointError(outcome)

    def _room_for(self, payload: RankPayload, wants: list[tuple[list[int], int]]) -> str | None:
        """Rank 0: make room for this save (:mod:`.room`) given every rank's (file sizes,
        pieces); the refusal, or None to go ahead."""
        if self.rank != 0:
            return None
        step = payload.step
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            fields = len(json.dumps(payload.index_fields, indent=1, default=str))
            need = needed_bytes(self.root, [sizes for sizes, _ in wants], sum(n for _, n in wants), fields)
            return make_room(self.root, step, need, self.keep, self.token, self.started, self.log)
        except Exception as e:  # noqa: BLE001 - sent to every rank, which then raises it
            return f"checkpoint step {step} in {self.root} failed before writing: {e}"

    def _discard(self, tmp: Path) -> None:
        """A failed save leaves nothing: each rank removes its own files, rank 0 the
        folder (every rank's writing ended before the outcome was broadcast)."""
        for name in rank_file_names(self.rank):
            try:
                (tmp / name).unlink()
            except OSError:
                pass
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)

    def _finalize(self, index: Index, tmp: Path, final: Path) -> None:
        index.write(tmp / "index.json")
        _fsync_dir(tmp)
        _phase("index_written")
        if final.exists():  # a checkpoint of this step from before a resume: replace it
            old = final.with_name(f"{final.name}.old-{self.token}")
            os.replace(final, old)
            try:
                os.replace(tmp, final)
            except OSError:
                os.replace(old, final)  # the failed save leaves the checkpoint it would replace
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
        _fsync_dir(self.root)
        _phase("renamed")
        _write_text_atomic(self.root / LATEST, final.name + "\n")
        self._prune()

    def _prune(self) -> None:
        """Drop checkpoints beyond the newest ``keep``."""
        if self.keep <= 0:
            return
        latest = read_latest(self.root)
        complete = complete_checkpoints(self.root)
        for _, path in complete[:-self.keep]:
            if latest is None or path.resolve() != latest.resolve():
                shutil.rmtree(path, ignore_errors=True)

    def _write_wait_s(self, wants: list[tuple[list[int], int]] | None) -> float | None:
        """Rank 0: how long the ranks wait for the slowest writer (:func:`write_wait_s`)."""
        if self.rank != 0 or not wants:
            return None
        return write_wait_s(self.comm_timeout_s, max(sum(sizes) for sizes, _ in wants))

    def _wait_for_writers(self, step: int, wait_s: float | None) -> None:
        """Every rank has written its files, or one is named after ``wait_s``: the group's own
        timeout is the job's communication timeout, which a slow write may exceed."""
        if self.group is None or self.world_size == 1 or wait_s is None:
            return
        try:
            with patient(self.group, wait_s, self.group_timeout_s):
                dist.barrier(group=self.group)
        except RuntimeError as e:
            raise CheckpointError(f"checkpoint step {step} in {self.root}: a rank did not finish "
                                  f"writing within {wait_s:.0f} s (lost, or its filesystem "
                                  f"slower than {SLOWEST_WRITE_BYTES_PER_S >> 20} MiB/s): "
                                  f"{str(e).splitlines()[0][:200]}") from e

    # -- collectives over the writer's own group --------------------------------------------------
    def _gather(self, obj) -> list:
        if self.group is None or self.world_size == 1:
            return [obj]
        out = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0, group=self.group)
        return out

    def _broadcast(self, obj):
        if self.group is None or self.world_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]
