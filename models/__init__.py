"""Model families (installed as ``parallel3d.models``). They import nothing from parallel3d."""

if __name__ != "parallel3d.models":  # the checkout's root on sys.path: not our name (kernels/_import_name.py)
    from parallel3d.kernels._import_name import yield_name

    yield_name(__name__, __path__[0])
