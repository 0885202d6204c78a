"""The planner's pipeline moments (``planner/moments.py``): the activation peak from the
undominated moments only, and the walk cut at 2 pp micro-batches, each against the walk
over every moment of the plan the runtime runs."""

from __future__ import annotations

from dataclasses import replace

import pytest

from parallel3d.planner.memory import backward_moments, stage_memory
from parallel3d.planner.moments import _peak_moments, peak_moments
from parallel3d.planner.spec import Layout, Workload

from test_planner import SMALL


@pytest.mark.parametrize("schedule,v", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("zb-v", 2)])
def test_the_peak_from_the_undominated_moments_equals_the_walk_over_all(schedule, v, monkeypatch):
    """stage_memory evaluates only the moments no other of their kind dominates
    (moments.peak_moments): the same peak, and the same bytes at the backward's peak, as
    every moment of the plan's walk, at every rank, with recomputation and on the CPU
    runtime too. (Where moments tie, e.g. a gradient transient larger than any moment's
    activations, the split into activations and buffers may name another of the tied.)"""
    import parallel3d.planner.memory as memory_module

    def every_moment(layout, m, r):
        return [(a, al, w, wl, last) for a, al, w, wl, _, last in backward_moments(layout, m, r)]

    model = replace(SMALL, n_layers=8)
    for recompute in ("none", "full"):
        work = Workload(model, 64, 32, "bf16")
        layout = Layout(pp=4, dp=2, micro_batch=2, schedule=schedule, virtual_stages=v, zero=1, recompute=recompute)
        pruned = [stage_memory(work, layout, r, gloo=True) for r in range(4)]
        monkeypatch.setattr(memory_module, "peak_moments", every_moment)
        walked = [stage_memory(work, layout, r, gloo=True) for r in range(4)]
        monkeypatch.undo()
        for a, b in zip(pruned, walked):
            assert a.peak == b.peak and a.backward_peak == b.backward_peak
            assert a.activations + a.backward_transient == b.activations + b.backward_transient


@pytest.mark.parametrize("schedule,v", [("1f1b", 1), ("interleaved", 2), ("interleaved", 3), ("zb-h1", 1),
                                        ("zb-v", 2)])
def test_past_2pp_micro_batches_the_moments_repeat(schedule, v):
    """peak_moments walks a plan of at most 2 pp micro-batches: at every rank, the
    undominated moments of the whole walk up to 5 pp micro-batches are those (interleaved:
    micro-batches a multiple of pp, as the trainer demands)."""
    cut = 0
    for pp in (2, 3, 4, 6):
        for m in range(2 * pp, 5 * pp + 1):
            if schedule == "interleaved" and m % pp:
                continue
            layout = Layout(pp=pp, schedule=schedule, virtual_stages=v)
            for r in range(pp):
                assert peak_moments(layout, m, r) == _peak_moments(schedule, pp, v, m, r), (pp, m, r)
            cut += m > 2 * pp
    assert cut > 0
    # gpipe's moments grow with the micro-batches: never cut
    gpipe = Layout(pp=2, schedule="gpipe")
    assert peak_moments(gpipe, 12, 0) == _peak_moments("gpipe", 2, 1, 12, 0) != _peak_moments("gpipe", 2, 1, 4, 0)
