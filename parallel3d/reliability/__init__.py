"""Reliability: no silent hangs, no silent bad numbers.

* :mod:`.watch` -- what this rank is doing (step, operation, group), a heartbeat of it
  in the rendezvous store, and the report a surviving rank prints when a collective
  times out or a peer dies.
* :mod:`.numerics` -- the non-finite step guard (skip or stop) and the loss-spike log.
"""

from .numerics import LossSpikeDetector, StepGuard, TrainingStopped, nonfinite_reason
from .watch import (CommFailure, CommWatch, backend_timeout_s, comm_failures_reported,
                    enable_flight_recorder, is_comm_error, wants_watchdog)

__all__ = ["CommWatch", "CommFailure", "LossSpikeDetector", "StepGuard", "TrainingStopped", "backend_timeout_s",
           "comm_failures_reported", "enable_flight_recorder", "is_comm_error", "nonfinite_reason",
           "wants_watchdog"]
