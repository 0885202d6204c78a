"""Model families (installed as ``parallel3d.models``). They import nothing from parallel3d."""

if __name__ != "parallel3d.models":  # the checkout's root on sys.path: not our name (kernels/_import_name.py)
    from parallel3d.kernels._import_name import yield_name

    yield_name(__name__, __path__[0])


# A model family is a folder here with a ``family.py`` (build_meta, initialize_,
# apply_recompute, activation_shape, tensor_parallel_problems, stage_costs, CONFIG), chosen by the
# config's ``model.family``: the trainer names no family. ``stage_costs``: the embedding's
# and the head's cost in decoder layers (the pipeline split and the autopilot's rebalance).
FAMILIES = ("llama",)


def model_family(name: str):
    """The ``family`` module of the model family ``name``."""
    import importlib

    if name not in FAMILIES:
        raise ValueError(f"unknown model.family '{name}': choose one of {list(FAMILIES)}")
    return importlib.import_module(f"{__name__}.{name}.family")


def family_of(config):
    """The ``family`` module whose ``CONFIG`` class ``config`` is (the planner holds a
    model's config, not its family's name)."""
    for name in FAMILIES:
        family = model_family(name)
        if isinstance(config, family.CONFIG):
            return family
    raise ValueError(f"no model family has the config {type(config).__name__}")
