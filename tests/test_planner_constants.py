"""The planner's copies of the code's sizes (it imports neither torch nor the trainer's
modules, so it keeps its own) are the code's: a change on one side fails here."""

from __future__ import annotations

from parallel3d.config import ParallelConfig
from parallel3d.planner import memory


def test_the_planners_copies_equal_the_codes_sizes():
    from parallel3d.kernels.deferred import FLUSH_BYTES
    from parallel3d.zero.grads import MAX_INFLIGHT

    assert memory.MAX_INFLIGHT == MAX_INFLIGHT
    assert memory.FLUSH_BYTES == FLUSH_BYTES
    assert memory.BUCKET_BYTES == int(ParallelConfig().bucket_mb * 2**20)
