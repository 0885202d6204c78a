"""Triton kernels (installed as ``parallel3d.kernels``): one kernel family per file, each
with its host launcher, ``autograd.Function`` and pure-torch reference. Imports torch and
triton only; nothing here knows about process groups."""
