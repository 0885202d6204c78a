"""Triton kernels (installed as ``parallel3d.kernels``): one kernel family per file, each
with its host launcher, ``autograd.Function`` and pure-torch reference. Imports torch and
triton only; nothing here knows about process groups."""

if __name__ != "parallel3d.kernels":  # the checkout's root on sys.path: not our name (kernels/_import_name.py)
    from ._import_name import yield_name

    yield_name(__name__, __path__[0])
