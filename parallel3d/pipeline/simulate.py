"""A pure simulation of a pipeline plan on every rank at once (no processes).

It plays the exact batches of sends and receives the runtime posts (``schedules.batches``)
the way the runtime posts and waits for them:

* before each step a rank posts its batch, then runs the step's actions; it waits for the
  batch just before the first action that reads a tensor the batch receives, or after
  the step's last action if none does (``runtime.py`` does the same);
* a send completes only when the matching receive is posted (rendezvous: no buffering),
  and waiting for a batch waits for its sends too (``sends_block=True``, the default:
  what a GPU stream does with NCCL's one handle per batch, and the model every plan is
  checked under), or only for the previous batch's sends (``sends_block=False``: the
  runtime on gloo, which keeps its sends in flight one batch longer);
* messages between two ranks in one direction are matched in the order they were posted.

It reports a deadlock (every rank waiting) and any mismatch (the k-th message sent from
rank a to rank b is not the one b expects as its k-th), and, with fixed costs for a
forward, a backward and a weight gradient (a backward the runtime runs undivided,
``actions.undivided_backwards``, costs B + W in its B and nothing in its W), the ideal
timeline: when each action runs, the
step's makespan, the bubble of every stage and the peak number of chunk-micro-batches
alive on it. Waiting later or for fewer sends only lets operations start earlier, so a
plan that passes under ``sends_block=True`` runs under the runtime's rules too.
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass, field

from .actions import inputs_of, undivided_backwards
from .schedules import SPLIT_BACKWARD, Message, batches, owners, plan


class ScheduleError(RuntimeError):
    pass


@dataclass
class SimResult:
    makespan: float
    busy: list[float]  # compute time of each stage
    peak_alive: list[int]  # most chunk-micro-batches forwarded and not yet finished (W, or
    #                        the undivided backward), per stage
    peak_to_b: list[int]  # most forwarded and not yet through B (activations held whole)
    runs: list[list[tuple[str, float, float]]] = field(default_factory=list)  # (action, start, end)

    def bubble(self, stage: int) -> float:
        return 1.0 - self.busy[stage] / self.makespan

    def mean_bubble(self) -> float:
        return sum(self.bubble(s) for s in range(len(self.busy))) / len(self.busy)

    def busy_by_op(self, stage: int) -> dict[str, float]:
        """Compute time of ``stage`` by action kind (F, B, W)."""
        out = {"F": 0.0, "B": 0.0, "W": 0.0}
        for name, t0, t1 in self.runs[stage]:
            out[name[0]] += t1 - t0
        return out


def simulate(name: str, pp: int, v: int, m: int, t_fwd: float = 1.0, t_bwd: float = 2.0,
             t_w: float = 0.0, sends_block: bool = True) -> SimResult:
    """Run schedule ``name`` on ``pp`` simulated ranks; raise :class:`ScheduleError` on a
    deadlock or a mismatched message. Costs of one chunk: ``t_fwd`` forward, ``t_bwd``
    input gradient, ``t_w`` weight gradient (a schedule that does not split its backward
    runs both in its B: ``t_bwd + t_w``)."""
    where = owners(name, pp, v)
    steps = [plan(name, pp, v, m, r) for r in range(pp)]
    split = name in SPLIT_BACKWARD
    _check_coverage(steps, where, v, m, split)
    cost = {"F": t_fwd, "B": t_bwd if split else t_bwd + t_w, "W": t_w}
    posts = [batches(name, pp, v, m, r) for r in range(pp)]
    whole = [undivided_backwards(s) if split else frozenset() for s in steps]
    sim = _Simulation(steps, posts, where, cost, sends_block, split, f"{name} pp={pp} v={v} m={m}", whole)
    while not all(sim.finished):
        # `|` rather than `or`: all three run each round.
        if not (sim.post_batches() | sim.match_messages() | sim.run_ranks()):
            waiting = {r: sim.batches[r][sim.pos[r]] for r in range(pp) if not sim.finished[r]}
            raise ScheduleError(f"{sim.label} deadlocks: ranks wait on {waiting}")
    return SimResult(makespan=max(sim.now), busy=sim.busy, peak_alive=sim.peak,
                     peak_to_b=sim.peak_to_b, runs=sim.runs)


class _Simulation:
    """The state of every simulated rank: which batch it is in, and the clock."""

    def __init__(self, steps, batches, owners: list[int], cost: dict, sends_block: bool,
                 split: bool, label: str, whole: list[frozenset]):
        pp = len(steps)
        self.steps, self.batches, self.owners, self.cost = steps, batches, owners, cost
        self.whole = whole  # per rank: (chunk, mb) whose backward runs undivided in its B
        self.sends_block, self.split, self.label = sends_block, split, label
        self.now = [0.0] * pp  # when each rank finished its last computation
        self.pos = [0] * pp  # the batch (and step) each rank is in
        self.posted = [False] * pp  # has it posted that batch yet
        self.waited = [False] * pp  # has it waited for that batch yet
        self.next_action = [0] * pp  # the next action of the step
        self.finished = [False] * pp
        self.received = [set() for _ in range(pp)]  # messages posted for receiving
        self.matched: dict[tuple, float] = {}  # (rank, batch, "s"/"r", index) -> time
        self.sends: dict[tuple[int, int], deque] = defaultdict(deque)  # (src, dst) -> (msg, time, key)
        self.recvs: dict[tuple[int, int], deque] = defaultdict(deque)
        self.alive, self.peak, self.busy = [0] * pp, [0] * pp, [0.0] * pp
        self.to_b, self.peak_to_b = [0] * pp, [0] * pp
        self.runs: list[list] = [[] for _ in range(pp)]

    def post_batches(self) -> bool:
        """Every rank between steps posts its next batch."""
        progress = False
        for r in range(len(self.now)):
            if self.finished[r] or self.posted[r]:
                continue
            b = self.pos[r]
            snd, rcv = self.batches[r][b]
            for i, msg in enumerate(snd):
                self.sends[(msg.src, msg.dst)].append((msg, self.now[r], (r, b, "s", i)))
            for i, msg in enumerate(rcv):
                self.recvs[(msg.src, msg.dst)].append((msg, self.now[r], (r, b, "r", i)))
                self.received[r].add(msg)
            self.posted[r], self.waited[r], self.next_action[r] = True, False, 0
            progress = True
        return progress

    def match_messages(self) -> bool:
        """Pair posted sends and receives per channel, in posting order."""
        progress = False
        for key in list(self.sends):
            while self.sends[key] and self.recvs[key]:
                (sent, t_s, k_s), (expected, t_r, k_r) = self.sends[key].popleft(), self.recvs[key].popleft()
                if sent != expected:
                    raise ScheduleError(f"{self.label}: rank {key[0]} sends {sent} while rank "
                                        f"{key[1]} expects {expected}")
                self.matched[k_s] = self.matched[k_r] = max(t_s, t_r)
                progress = True
        return progress

    def _needs(self, r: int, b: int) -> list[tuple]:
        """The operations that must be matched before rank ``r`` has waited for batch ``b``."""
        snd, rcv = self.batches[r][b]
        keys = [(r, b, "r", i) for i in range(len(rcv))]
        if self.sends_block or b == len(self.batches[r]) - 1:  # the last batch is flushed
            keys += [(r, b, "s", i) for i in range(len(snd))]
        if not self.sends_block and b > 0:
            keys += [(r, b - 1, "s", i) for i in range(len(self.batches[r][b - 1][0]))]
        return keys

    def _wait(self, r: int) -> bool:
        keys = self._needs(r, self.pos[r])
        if not all(k in self.matched for k in keys):
            return False
        self.now[r] = max([self.now[r]] + [self.matched[k] for k in keys])
        self.waited[r] = True
        return True

    def run_ranks(self) -> bool:
        """Each rank with its batch posted runs its step's actions as far as it can."""
        progress = False
        for r in range(len(self.now)):
            if self.finished[r] or not self.posted[r]:
                continue
            b = self.pos[r]
            step = self.steps[r][b] if b < len(self.steps[r]) else ()
            incoming = set(self.batches[r][b][1])
            while self.next_action[r] < len(step):
                a = step[self.next_action[r]]
                remote = [msg for msg in inputs_of(a, self.owners) if not msg.local]
                if any(msg not in self.received[r] for msg in remote):
                    raise ScheduleError(f"{self.label}: rank {r} runs {a} before receiving its input")
                if not self.waited[r] and any(msg in incoming for msg in remote) and not self._wait(r):
                    break
                self._compute(r, a)
                self.next_action[r] += 1
                progress = True
            if self.next_action[r] == len(step) and (self.waited[r] or self._wait(r)):
                self.pos[r], self.posted[r] = b + 1, False
                self.finished[r] = self.pos[r] == len(self.batches[r])
                progress = True
        return progress

    def _compute(self, r: int, a) -> None:
        cost = self.cost[a.op]
        whole = a.op != "F" and (a.chunk, a.mb) in self.whole[r]
        if whole:  # the whole backward in its B, nothing left for its W
            cost = self.cost["B"] + self.cost["W"] if a.op == "B" else 0.0
        self.runs[r].append((str(a), self.now[r], self.now[r] + cost))
        self.now[r] += cost
        self.busy[r] += cost
        if a.op == "F":
            self.alive[r] += 1
            self.to_b[r] += 1
        elif a.op == "B":
            self.to_b[r] -= 1
            self.alive[r] -= 0 if self.split and not whole else 1
        elif not whole:
            self.alive[r] -= 1
        self.peak[r] = max(self.peak[r], self.alive[r])
        self.peak_to_b[r] = max(self.peak_to_b[r], self.to_b[r])


def _check_coverage(steps, owners: list[int], v: int, m: int, split: bool) -> None:
    """Every (chunk, micro-batch) is forwarded once and backwarded once (and, split, its
    weight gradient computed once), on its own rank, the forward first, W after B; an
    input handed over on the rank (the V's turn) was produced before."""
    ops = "FBW" if split else "FB"
    for r, rank_steps in enumerate(steps):
        seen: dict = {}
        for step in rank_steps:
            for a in step:
                if owners[a.chunk] != r:
                    raise ScheduleError(f"rank {r} runs {a}, a chunk of rank {owners[a.chunk]}")
                key = (a.op, a.chunk, a.mb)
                if a.op not in ops or key in seen:
                    raise ScheduleError(f"rank {r} runs {a} twice or out of place")
                first = {"B": "F", "W": "B"}.get(a.op)
                if first and (first, a.chunk, a.mb) not in seen:
                    raise ScheduleError(f"rank {r} runs {a} before its {first}")
                for msg in inputs_of(a, owners):
                    producer = ("F" if msg.kind == "act" else "B", msg.chunk, msg.mb)
                    if msg.local and producer not in seen:
                        raise ScheduleError(f"rank {r} runs {a} before its input {producer}")
                seen[key] = True
        mine = [c for c, owner in enumerate(owners) if owner == r]
        want = {(op, c, i) for op in ops for c in mine for i in range(m)}
        if set(seen) != want:
            raise ScheduleError(f"rank {r} misses {sorted(want - set(seen))[:4]}")


def theoretical_bubble(name: str, pp: int, v: int, m: int) -> float:
    """Bubble fraction of the step (idle / makespan) for equal stages whose backward
    costs twice the forward (``B = 2F``; split schedules: ``B = W = F``):
    ``(pp - 1) / (m + pp - 1)`` for gpipe and 1f1b, ``(pp - 1) / (v m + pp - 1)`` for
    interleaved (each chunk does 1/v of a stage's work, so the ramp is v times shorter),
    ``(pp - 1) / (3 m + pp - 1)`` for zb-h1 and ``(pp - 1) / (6 m + pp - 1)`` for zb-v
    (``m >= 2 pp - 1``; its warm-up needs that many)."""
    if name == "zb-v":
        if m < 2 * pp - 1:
            raise ValueError(f"zb-v's bubble has a closed form for m >= 2 pp - 1, got m {m}, pp {pp}")
        return (pp - 1) / (6 * m + pp - 1)
    vm = {"interleaved": v * m, "zb-h1": 3 * m}.get(name, m)
    return (pp - 1) / (vm + pp - 1)


__all__ = ["Message", "ScheduleError", "SimResult", "simulate", "theoretical_bubble"]
