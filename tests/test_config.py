"""Config loading: TOML recipes, dotted overrides, types, unknown keys."""

from __future__ import annotations

import pytest

from parallel3d.cli import default_recipe
from parallel3d.config import load_config, parse_overrides
from parallel3d.errors import UserError


def test_default_recipe_loads_with_required_keys():
    cfg = load_config(default_recipe())
    for section, key in [("parallel", "tp"), ("parallel", "pp"), ("parallel", "dp"),
                         ("launch", "nproc"), ("train", "steps"), ("train", "seed"),
                         ("train", "global_batch"), ("train", "micro_batch"),
                         ("train", "seq_len"), ("train", "lr"), ("train", "grad_clip"),
                         ("run", "dir")]:
        assert hasattr(getattr(cfg, section), key), f"{section}.{key}"
    assert cfg.parallel.dp * cfg.parallel.tp * cfg.parallel.pp == cfg.launch.nproc


def test_overrides_parse_as_toml_literals_and_win_over_the_recipe(tmp_path):
    recipe = tmp_path / "r.toml"
    recipe.write_text("[train]\nlr = 0.1\nsteps = 5\n[run]\ndir = 'a'\n")
    cfg = load_config(recipe, ["--train.lr=3e-4", "--parallel.dp", "2", "--run.dir=b/c",
                               "--model.tie_embeddings=true"])
    assert cfg.train.lr == 3e-4 and cfg.train.steps == 5
    assert cfg.parallel.dp == 2 and cfg.run.dir == "b/c" and cfg.model.tie_embeddings is True


def test_int_is_accepted_for_float_but_not_the_reverse():
    assert load_config(None, ["--train.lr=1"]).train.lr == 1.0
    with pytest.raises(UserError, match="train.steps expects int, got 2.5"):
        load_config(None, ["--train.steps=2.5"])
    with pytest.raises(UserError, match="expects int"):
        load_config(None, ["--parallel.tp=true"])


@pytest.mark.parametrize("args,message", [
    (["--train.lrr=1"], "unknown config key 'train.lrr' (did you mean 'train.lr'?)"),
    (["--trian.lr=1"], "unknown config key 'trian' (did you mean 'train'?)"),
    (["--train.lr=abc"], "train.lr expects float, got 'abc'"),
    (["train.lr=1"], "unexpected argument 'train.lr=1'"),
    (["--train.lr"], "'--train.lr' needs a value"),
])
def test_bad_overrides_name_the_key(args, message):
    with pytest.raises(UserError) as e:
        load_config(None, args)
    assert message in str(e.value)


def test_missing_and_invalid_recipe(tmp_path):
    with pytest.raises(UserError, match="not found"):
        load_config(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\n")
    with pytest.raises(UserError, match="not valid TOML"):
        load_config(bad)


def test_parse_overrides_nests():
    assert parse_overrides(["--a.b.c=1", "--a.d='x'"]) == {"a": {"b": {"c": 1}, "d": "x"}}


def test_a_misspelt_choice_is_one_line_with_the_nearest_value_and_all_allowed(capsys):
    from parallel3d.cli import main

    assert main(["train", "--parallel.schedule=1fb1"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].endswith("parallel.schedule '1fb1' is not supported (did you mean '1f1b'?): "
                             "use gpipe, 1f1b, interleaved, zb-h1, zb-v"), lines


@pytest.mark.parametrize("args,message", [
    (["--train.recompute=ful"], "train.recompute 'ful' is not supported (did you mean 'full'?): "
                                "use none, full, selective"),
    (["--parallel.zero=4"], "parallel.zero 4 is not supported: use 0, 1, 2, 3"),
    (["--parallel.zero=true"], "parallel.zero True is not supported"),  # a bool is not the int 1
    (["--parallel.zero='1'"], "parallel.zero '1' is not supported: use 0, 1, 2, 3"),
    (["--observability.progress=yes"], "observability.progress 'yes' is not supported: use auto, on, off"),
])
def test_choices_are_checked_as_the_config_loads(args, message):
    with pytest.raises(UserError) as e:
        load_config(None, args)
    assert str(e.value) == message or str(e.value).startswith(message), str(e.value)
    assert load_config(None, ["--parallel.zero=2"]).parallel.zero == 2


def _choice_fields(cls=None, where=""):
    """(dotted key, allowed values) of every Literal field of the job config."""
    import dataclasses
    import typing

    from parallel3d.config import JobConfig

    cls = cls or JobConfig
    for f in dataclasses.fields(cls):
        tp = typing.get_type_hints(cls)[f.name]
        if dataclasses.is_dataclass(tp):
            yield from _choice_fields(tp, f"{f.name}.")
        elif typing.get_origin(tp) is typing.Literal:
            yield f"{where}{f.name}", set(typing.get_args(tp))


def test_each_choice_is_what_the_code_dispatching_on_it_handles():
    """The allowed values of a choice are the keys of the table the code looks them up in,
    so neither can gain a value the other lacks."""
    from parallel3d.distributed import HOST_MEMORY
    from parallel3d.data.packing import PACKINGS
    from parallel3d.flops import RECOMPUTE_FLOPS
    from parallel3d.kernels.gemm import BACKENDS
    from parallel3d.models.llama.parallelize import RECOMPUTE
    from parallel3d.pipeline.schedules import SCHEDULES
    from parallel3d.train.optim import STORAGE_DTYPES
    from parallel3d.zero.grads import REDUCE_DTYPES

    tables = {"parallel.schedule": [SCHEDULES], "parallel.linear_backend": [BACKENDS],
              "train.recompute": [RECOMPUTE, RECOMPUTE_FLOPS], "train.dtype": [STORAGE_DTYPES],
              "data.packing": [PACKINGS], "launch.host_memory": [HOST_MEMORY],
              "parallel.reduce_dtype": [REDUCE_DTYPES]}
    # dispatched by comparing with one or two of the values, not through a table
    branches = {"parallel.zero", "parallel.cp_comm", "data.source", "launch.backend", "observability.progress",
                "reliability.on_nonfinite", "reliability.watchdog"}
    fields = dict(_choice_fields())
    assert set(fields) == set(tables) | branches, set(fields) ^ (set(tables) | branches)
    for key, found in tables.items():
        for table in found:
            assert set(table) == fields[key], (key, set(table), fields[key])


def test_a_section_built_in_code_checks_its_choices():
    """A section built in code (or copied by ``dataclasses.replace``) refuses a value outside
    a choice at once, in the loader's words, for every choice of the job config; its
    defaults and every allowed value build."""
    import dataclasses

    from parallel3d.config import JobConfig

    job = JobConfig()
    for key, allowed in _choice_fields():
        section, name = key.split(".")
        cls = type(getattr(job, section))
        for value in allowed:
            assert getattr(cls(**{name: value}), name) == value
        bad = "not-a-choice"
        with pytest.raises(UserError, match=rf"^{key} '{bad}' is not supported"):
            cls(**{name: bad})
        with pytest.raises(UserError, match=rf"^{key} '{bad}' is not supported"):
            dataclasses.replace(getattr(job, section), **{name: bad})
