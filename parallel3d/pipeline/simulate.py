"""A pure simulation of a pipeline plan on every rank at once (no processes).

It plays the exact batches of sends and receives the runtime posts (``exchanges``) under
the strictest point-to-point model that NCCL and gloo share:

* a rank posts all operations of a batch, then waits for all of them, then computes;
* a send completes only when the matching receive is posted (rendezvous: no buffering);
* messages between two ranks in one direction are matched in the order they were posted.

It reports a deadlock (every rank waiting) and any mismatch (the k-th message sent from
rank a to rank b is not the one b expects as its k-th), and, with fixed costs for a
forward and a backward, the ideal timeline: when each action runs, the step's makespan,
the bubble of every stage and the peak number of micro-batches alive on it.
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass, field

from .schedules import Message, exchanges, plan


class ScheduleError(RuntimeError):
    pass


@dataclass
class SimResult:
    makespan: float
    busy: list[float]  # compute time of each stage
    peak_alive: list[int]  # most micro-batches forwarded and not yet backwarded, per stage
    runs: list[list[tuple[str, float, float]]] = field(default_factory=list)  # (action, start, end)

    def bubble(self, stage: int) -> float:
        return 1.0 - self.busy[stage] / self.makespan

    def mean_bubble(self) -> float:
        return sum(self.bubble(s) for s in range(len(self.busy))) / len(self.busy)


def simulate(name: str, pp: int, v: int, m: int, t_fwd: float = 1.0, t_bwd: float = 2.0) -> SimResult:
    """Run schedule ``name`` on ``pp`` simulated ranks; raise :class:`ScheduleError` on a
    deadlock or a mismatched message. ``t_fwd``/``t_bwd`` are the costs of one chunk."""
    n_chunks = pp * v
    steps = [plan(name, pp, v, m, r) for r in range(pp)]
    batches = [exchanges(s, pp, n_chunks) for s in steps]
    _check_coverage(steps, pp, v, m)

    now = [0.0] * pp  # when each rank finished its last computation
    pos = [0] * pp  # index of the batch each rank is in (posted, not complete)
    posted = [False] * pp
    sends: dict[tuple[int, int], deque] = defaultdict(deque)  # (src, dst) -> [(msg, time)]
    recvs: dict[tuple[int, int], deque] = defaultdict(deque)
    pending = [0] * pp  # operations of the current batch not yet matched
    done_at = [0.0] * pp  # latest match time in the current batch
    alive, peak = [0] * pp, [0] * pp
    busy = [0.0] * pp
    runs: list[list] = [[] for _ in range(pp)]

    def post(r: int) -> None:
        snd, rcv = batches[r][pos[r]]
        for msg in snd:
            sends[(msg.src, msg.dst)].append((msg, now[r]))
        for msg in rcv:
            recvs[(msg.src, msg.dst)].append((msg, now[r]))
        pending[r] = len(snd) + len(rcv)
        done_at[r] = now[r]
        posted[r] = True

    finished = 0
    while finished < pp:
        progress = False
        for r in range(pp):
            if pos[r] < len(batches[r]) and not posted[r]:
                post(r)
                progress = True
        for key in list(sends):
            while sends[key] and recvs[key]:
                (sent, t_s), (expected, t_r) = sends[key].popleft(), recvs[key].popleft()
                if sent != expected:
                    raise ScheduleError(f"{name} pp={pp} v={v} m={m}: rank {key[0]} sends "
                                        f"{sent} while rank {key[1]} expects {expected}")
                t = max(t_s, t_r)
                for rank in key:
                    pending[rank] -= 1
                    done_at[rank] = max(done_at[rank], t)
                progress = True
        for r in range(pp):
            if posted[r] and pending[r] == 0:
                now[r] = done_at[r]
                step_index = pos[r]
                posted[r] = False
                pos[r] += 1
                if step_index < len(steps[r]):
                    for a in steps[r][step_index]:
                        cost = t_fwd if a.op == "F" else t_bwd
                        runs[r].append((str(a), now[r], now[r] + cost))
                        now[r] += cost
                        busy[r] += cost
                        alive[r] += 1 if a.op == "F" else -1
                        peak[r] = max(peak[r], alive[r])
                else:
                    finished += 1
                progress = True
        if not progress:
            waiting = {r: batches[r][pos[r]] for r in range(pp) if pos[r] < len(batches[r])}
            raise ScheduleError(f"{name} pp={pp} v={v} m={m} deadlocks: ranks wait on {waiting}")
    return SimResult(makespan=max(now), busy=busy, peak_alive=peak, runs=runs)


def _check_coverage(steps, pp: int, v: int, m: int) -> None:
    """Every (chunk, micro-batch) is forwarded once and backwarded once, on its own rank,
    the forward first."""
    for r, rank_steps in enumerate(steps):
        seen: dict = {}
        for step in rank_steps:
            for a in step:
                if a.chunk % pp != r:
                    raise ScheduleError(f"rank {r} runs {a}, a chunk of rank {a.chunk % pp}")
                key = (a.op, a.chunk, a.mb)
                if key in seen:
                    raise ScheduleError(f"rank {r} runs {a} twice")
                if a.op == "B" and ("F", a.chunk, a.mb) not in seen:
                    raise ScheduleError(f"rank {r} runs {a} before its forward")
                seen[key] = True
        want = {(op, r + j * pp, i) for op in "FB" for j in range(v) for i in range(m)}
        if set(seen) != want:
            raise ScheduleError(f"rank {r} misses {sorted(want - set(seen))[:4]}")


def theoretical_bubble(name: str, pp: int, v: int, m: int) -> float:
    """Bubble fraction of the step (idle / makespan) for equal stages, B = 2F:
    ``(pp - 1) / (m + pp - 1)`` for gpipe and 1f1b, ``(pp - 1) / (v m + pp - 1)`` for
    interleaved (each chunk does 1/v of a stage's work, so the ramp is v times shorter)."""
    vm = v * m if name == "interleaved" else m
    return (pp - 1) / (vm + pp - 1)


__all__ = ["Message", "ScheduleError", "SimResult", "simulate", "theoretical_bubble"]
