"""Seeing where the time goes: the per-step breakdown, FLOPs and MFU, peak memory,
stragglers, the banner and summary, the live progress line, optional TensorBoard / W&B
sinks and the run report.

* ``stats``: the breakdown of a step from the pipeline timeline's spans, the per-rank
  exchange (riding the trainer's one all-reduce per step), MFU, peak memory and stragglers.
* ``progress``: rank 0's progress bar on a terminal.
* ``console``: the banner before a run and the summary after it.
* ``sinks``: TensorBoard and Weights & Biases, when installed and asked for.
* ``report``: ``parallel3d report RUN_DIR`` (a PNG and a text summary).
"""
