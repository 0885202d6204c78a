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

The runtime waits for its sends one batch later than this model (``p2p.StageComm``); that
only lets operations start earlier, so a plan that passes here runs there too.
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
    steps = [plan(name, pp, v, m, r) for r in range(pp)]
    _check_coverage(steps, pp, v, m)
    sim = _Simulation(steps, pp * v, t_fwd, t_bwd, f"{name} pp={pp} v={v} m={m}")
    while not sim.finished():
        # `|` rather than `or`: all three run each round.
        progress = sim.post_batches() | sim.match_messages() | sim.complete_batches()
        if not progress:
            waiting = {r: sim.batches[r][sim.pos[r]] for r in range(pp) if not sim.done(r)}
            raise ScheduleError(f"{sim.label} deadlocks: ranks wait on {waiting}")
    return SimResult(makespan=max(sim.now), busy=sim.busy, peak_alive=sim.peak, runs=sim.runs)


class _Simulation:
    """The state of every simulated rank: which batch it is in, and the clock."""

    def __init__(self, steps, n_chunks: int, t_fwd: float, t_bwd: float, label: str):
        pp = len(steps)
        self.steps, self.label = steps, label
        self.cost = {"F": t_fwd, "B": t_bwd}
        self.batches = [exchanges(s, pp, n_chunks) for s in steps]
        self.now = [0.0] * pp  # when each rank finished its last computation
        self.pos = [0] * pp  # the batch each rank is in
        self.posted = [False] * pp  # has it posted that batch's operations yet
        self.pending = [0] * pp  # operations of that batch not yet matched
        self.done_at = [0.0] * pp  # latest match time in that batch
        self.sends: dict[tuple[int, int], deque] = defaultdict(deque)  # (src, dst) -> (msg, time)
        self.recvs: dict[tuple[int, int], deque] = defaultdict(deque)
        self.alive, self.peak, self.busy = [0] * pp, [0] * pp, [0.0] * pp
        self.runs: list[list] = [[] for _ in range(pp)]

    def done(self, r: int) -> bool:
        return self.pos[r] == len(self.batches[r])

    def finished(self) -> bool:
        return all(self.done(r) for r in range(len(self.now)))

    def post_batches(self) -> bool:
        """Every rank between batches posts its next one."""
        progress = False
        for r in range(len(self.now)):
            if not self.done(r) and not self.posted[r]:
                snd, rcv = self.batches[r][self.pos[r]]
                for msg in snd:
                    self.sends[(msg.src, msg.dst)].append((msg, self.now[r]))
                for msg in rcv:
                    self.recvs[(msg.src, msg.dst)].append((msg, self.now[r]))
                self.pending[r], self.done_at[r] = len(snd) + len(rcv), self.now[r]
                self.posted[r] = progress = True
        return progress

    def match_messages(self) -> bool:
        """Pair posted sends and receives per channel, in posting order."""
        progress = False
        for key in list(self.sends):
            while self.sends[key] and self.recvs[key]:
                (sent, t_s), (expected, t_r) = self.sends[key].popleft(), self.recvs[key].popleft()
                if sent != expected:
                    raise ScheduleError(f"{self.label}: rank {key[0]} sends {sent} while rank "
                                        f"{key[1]} expects {expected}")
                for rank in key:
                    self.pending[rank] -= 1
                    self.done_at[rank] = max(self.done_at[rank], t_s, t_r)
                progress = True
        return progress

    def complete_batches(self) -> bool:
        """A rank whose batch is fully matched runs its next step."""
        progress = False
        for r in range(len(self.now)):
            if self.posted[r] and self.pending[r] == 0:
                self.now[r] = self.done_at[r]
                step = self.pos[r]
                self.posted[r], self.pos[r] = False, step + 1
                if step < len(self.steps[r]):
                    for a in self.steps[r][step]:
                        self._compute(r, a)
                progress = True
        return progress

    def _compute(self, r: int, a) -> None:
        cost = self.cost[a.op]
        self.runs[r].append((str(a), self.now[r], self.now[r] + cost))
        self.now[r] += cost
        self.busy[r] += cost
        self.alive[r] += 1 if a.op == "F" else -1
        self.peak[r] = max(self.peak[r], self.alive[r])


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
