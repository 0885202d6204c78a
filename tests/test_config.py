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
