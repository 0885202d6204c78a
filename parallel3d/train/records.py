"""A step's record on its way from the step to rank 0's files.

A step ends with its loss, gradient norm and timings in a record (the same on every
rank); its per-rank figures (breakdown, bubble, per-rank times and memory, stragglers)
are this rank's alone until a collective carries them: the next step's one all-reduce,
or a collective of their own at the end of a run or before a checkpoint. So a record
waits here, *pending*, with this rank's figures, until the every-rank summary completes
it; then rank 0 writes it (``metrics.jsonl``, the sinks), prints straggler warnings, and
appends the per-rank rows of a straggler check to ``ranks.jsonl``. The console line (or
the progress bar) shows a step as it ends, before it is complete.
"""

from __future__ import annotations

import sys
from pathlib import Path

from parallel3d.config import JobConfig
from parallel3d.observe.progress import ProgressBar, wants_bar
from parallel3d.observe.sinks import Sinks
from parallel3d.observe.stats import StepObserver, straggler_warning
from parallel3d.pipeline.timeline import Timeline
from parallel3d.train.metrics import MetricsLogger


class StepRecords:
    """Pending and completed records of one trainer; ``metrics`` and ``sinks`` are rank
    0's writers when it logs (None elsewhere)."""

    def __init__(self, cfg: JobConfig, observer: StepObserver, timeline: Timeline, is_logger: bool,
                 resume_step: int | None):
        self.cfg, self.observer, self.timeline = cfg, observer, timeline
        self.metrics = MetricsLogger(Path(cfg.run.dir), cfg.to_dict(), resume_step=resume_step) if is_logger else None
        self.sinks = Sinks(cfg.observability, Path(cfg.run.dir), cfg.to_dict()) if is_logger else None
        self.bar: ProgressBar | None = None
        # (record, this rank's figures) of the last step, until a collective carries the
        # figures of every rank; then the record is complete
        self.pending: tuple[dict, list[float]] | None = None
        self._completed: list[dict] = []
        self._rank_tables: list[dict] = []  # per-rank rows of straggler checks (rank 0)

    def hold(self, record: dict, row: list[float]) -> None:
        """The step just ended: its record, and this rank's figures for the next collective."""
        self.pending = (record, row)

    def complete(self, summary: dict) -> None:
        """Add the every-rank figures to the pending record; every ``straggler_interval``
        steps, also the stragglers (per-rank rows gathered to rank 0 only, for ranks.jsonl)."""
        record = self.pending[0]
        record.update(summary)
        checked = self.observer.check_stragglers(record["step"])
        if checked is not None:
            record["stragglers"], table = checked
            self._rank_tables.append({"step": record["step"], "ranks": table})
        self.pending = None
        self._completed.append(record)

    def finish(self) -> None:
        """Complete the pending record by a collective of its own (every rank calls it)."""
        if self.pending is not None:
            self.complete(self.observer.gather(self.pending[1]))

    def take(self) -> list[dict]:
        """Records completed since the last call (no collective)."""
        done, self._completed = self._completed, []
        return done

    def flush(self) -> None:
        """Complete the pending record and write every completed one (collective)."""
        self.finish()
        self.report(self.take())

    def log_event(self, event: dict) -> None:
        """A record that is not a step (the autopilot's decisions) into metrics.jsonl."""
        if self.metrics is not None:
            self.metrics.log(event)

    def open_bar(self) -> None:
        """Rank 0's progress bar, when ``observability.progress`` wants one."""
        if self.bar is None and self.metrics is not None and wants_bar(self.cfg.observability.progress):
            self.bar = ProgressBar(self.cfg.train.steps)

    def show(self, record: dict) -> None:
        """Rank 0, as the step ends: the progress bar, or the console line every
        ``log_interval`` steps and at the last."""
        if self.metrics is None:
            return
        step = record["step"]
        if self.bar is not None:
            self.bar.update(record)
        elif step % self.cfg.train.log_interval == 0 or step == self.cfg.train.steps:
            own_wait = self.timeline.step_breakdown().get("data", 0.0)
            self.metrics.show(record, data_wait_s=own_wait)

    def report(self, records: list[dict]) -> None:
        """Rank 0, once records are complete: metrics.jsonl, the sinks, straggler warnings."""
        if self.metrics is None:
            return
        for table in self._rank_tables:
            self.metrics.log_ranks(table)
        self._rank_tables = []
        for record in records:
            self.metrics.log(record)
            self.sinks.log(record)
            if self.bar is not None:
                self.bar.complete(record)  # its memory, for the next lines
            for s in record.get("stragglers", []):  # printed above the bar (it holds the streams)
                print(straggler_warning(s, self.cfg.observability.straggler_factor), file=sys.stderr, flush=True)

    def close(self) -> None:
        """Close the bar and rank 0's files."""
        if self.metrics is not None:
            if self.bar is not None:
                self.bar.close()
                self.bar = None
            self.metrics.close()
            self.sinks.close()
