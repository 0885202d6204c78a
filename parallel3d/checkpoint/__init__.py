"""Sharded checkpoints: save at any layout, resume at any other, convert to and from
Hugging Face and DeepSpeed. See :mod:`.format` for the on-disk format."""

from .checkpointer import Checkpointer
from .errors import CheckpointError
from .reader import CheckpointReader, find_checkpoint

__all__ = ["Checkpointer", "CheckpointError", "CheckpointReader", "find_checkpoint"]
