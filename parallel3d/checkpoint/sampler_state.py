"""The data position in a checkpoint: what the trainer's sampler saves, and its restore.

A sampler with ``state_dict`` (or the prefetching loader in front of it) saves and loads
its own state; the step-indexed sampler's position is the step, so only what it depends
on is saved (seed, sample count) and checked on resume, with the global batch. Another
framework's checkpoint carries no position: the sampler continues at
``step * global_batch``. :class:`.checkpointer.Checkpointer` calls these.
"""

from __future__ import annotations

from pathlib import Path

from .errors import CheckpointError


def sampler_state_at(trainer, step: int) -> dict:
    """The data position after ``step`` (``trainer.step`` or the step before it: a
    stopped step consumed one global batch that its checkpoint gives back)."""
    s = trainer.sampler
    if not hasattr(s, "state_dict"):
        # The step-indexed sampler: its position is the step; record what it depends on.
        return {"consumed_samples": step * s.global_batch, "seed": s.seed,
                "num_samples": s.num_samples}
    state = s.state_dict()
    if step != trainer.step:
        consumed = state["consumed_samples"] - (trainer.step - step) * s.global_batch
        state["consumed_samples"] = consumed
        if "epoch" in state:
            state["epoch"] = consumed // s.num_samples
    return state


def foreign_sampler_state(trainer, step: int) -> dict | None:
    """The position to resume at from another framework's checkpoint of ``step`` (None: the
    step-indexed sampler, whose position is the step)."""
    s = trainer.sampler
    if not hasattr(s, "state_dict"):
        return None
    return {**s.state_dict(), "consumed_samples": step * s.global_batch}


def load_sampler_state(trainer, state: dict | None, step: int, folder: Path) -> None:
    """Restore ``state`` (saved at ``step`` in the checkpoint ``folder``) into the trainer's
    loader or sampler; the step-indexed sampler's is checked against this run's."""
    s = trainer.sampler
    if state is None:
        return
    # A prefetching loader restarts from the restored position (what it read ahead
    # belongs to the old one); else the sampler itself.
    loader = getattr(getattr(trainer, "data", None), "loader", None)
    for target in (loader, s):
        if target is not None and hasattr(target, "load_state_dict"):
            target.load_state_dict(state)
            return
    for key, mine in (("seed", s.seed), ("num_samples", s.num_samples)):
        if state.get(key) != mine:
            raise CheckpointError(f"{folder}: the data sampler was saved with {key} "
                                  f"{state.get(key)}, this run has {mine} (resume with the same "
                                  "data, train.seq_len and train.seed)")
    if state.get("consumed_samples") != step * s.global_batch:
        raise CheckpointError(f"{folder}: {state.get('consumed_samples')} samples were "
                              f"consumed in {step} steps; train.global_batch {s.global_batch} "
                              "differs from the saved run's: resume with the same global batch")
