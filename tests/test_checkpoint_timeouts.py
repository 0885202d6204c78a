"""A save's waits: the checkpoint group carries the job's communication timeout, and the
write phase its own allowance (``save.write_wait_s``), so that a rank lost during a save is
found in seconds (torch's default for a new group is 30 minutes), while a rank that is only
slow to write is waited for even past the communication timeout."""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

import parallel3d.checkpoint.save as save
from parallel3d.checkpoint.errors import CheckpointError
from parallel3d.checkpoint.reader import read_latest
from parallel3d.checkpoint.save import CheckpointWriter

from test_checkpoint_space import payload

COMM_TIMEOUT_S = 2.0  # the group's timeout, as the checkpointer sets it from the job's


def _save_with_a_slow_writer(root: str, write_s: float, rate: int, slow: int = 1) -> dict:
    """Rank ``slow``'s files take ``write_s`` to write; the allowance is the comm timeout plus the
    largest rank's bytes at ``rate`` bytes/s."""
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=COMM_TIMEOUT_S))
    writer = CheckpointWriter(Path(root), rank, world, group, token="run", comm_timeout_s=COMM_TIMEOUT_S,
                              group_timeout_s=COMM_TIMEOUT_S)
    writer.save(payload(2, rank, world))
    real_write, real_rate = save.write_rank_files, save.SLOWEST_WRITE_BYTES_PER_S
    done = Path(root) / "slow-rank-wrote"
    save.SLOWEST_WRITE_BYTES_PER_S = rate

    def slowly(folder, p):
        time.sleep(write_s)
        out = real_write(folder, p)
        done.touch()
        return out

    if rank == slow:
        save.write_rank_files = slowly
    start = time.monotonic()
    error, wrote_before = None, None
    try:
        writer.save(payload(4, rank, world))
    except CheckpointError as e:
        error, wrote_before = str(e), done.exists()
    finally:
        save.write_rank_files, save.SLOWEST_WRITE_BYTES_PER_S = real_write, real_rate
    elapsed = time.monotonic() - start
    dist.barrier()  # on the world group: the test's group may hold the failed barrier's leftovers
    dist.destroy_process_group(group)
    return {"error": error, "slow_rank_had_written": wrote_before, "s": elapsed,
            "latest": read_latest(Path(root)).name}


def test_a_writer_slower_than_the_comm_timeout_is_waited_for(pools, tmp_path):
    # ~66 KiB a rank at 8 KiB/s: ~8 s of allowance on top of 2; rank 0 (which the others'
    # barrier sends wait for) writes for 5 s, more than twice the group's timeout
    results = pools(2).run(_save_with_a_slow_writer, str(tmp_path), 5.0, 8 * 1024, 0)
    for res in results:
        assert res["error"] is None, res
        assert res["latest"] == "step_00000004"
    assert results[1]["s"] > 5.0  # rank 1 did wait for rank 0's files


def test_a_writer_that_does_not_arrive_is_named_without_waiting_for_it(pools, tmp_path):
    # allowance ~2 s (a fast filesystem's rate), rank 1 takes 8 s: rank 0 fails while rank 1
    # is still writing, and the last complete checkpoint stays the latest
    results = pools(2).run(_save_with_a_slow_writer, str(tmp_path), 8.0, 2**30)
    first = results[0]
    assert first["error"] is not None and "did not finish writing" in first["error"], first
    assert "\n" not in first["error"]
    assert first["slow_rank_had_written"] is False, "rank 0 waited for the slow rank"
    for res in results:
        assert res["latest"] == "step_00000002"
