"""What a run checks before its first step, the dry run checks too, with the same message
(issue 37, point 2); and every data / eval message that suggests a change suggests one
that works: each suggestion is fed back in and that error is gone (point 3).

Failures a run meets before its first step, each under `train --dry-run`, `train` (the
launching process) and the worker's own checks (``run_worker``, as a launched rank):

1. the validation split holds fewer than eval.batches * global_batch sequences (point 2)
2. train.seq_len beyond the Hugging Face model's context (config.json)
3. data.path is not a prepared dataset
4. the dataset's vocabulary exceeds the model's
5. the dataset was tokenized with another tokenizer than the HF model's
6. run.dir cannot be created (under a file)
7. checkpoint.resume names no folder

Suggestions fed back in (each message that suggests a change in the data / eval checks):
the validation split too small (fewer batches, no evaluation, a larger --val-fraction for
prepared data and data.val_fraction for the stdlib corpus; with no held-out sequence
at all, no fewer-batches suggestion), the vocabulary too large (model.vocab_size), the
tokenizer differs (prepare again with the model's), seq_len over the model's context,
data.val_fraction given with prepared data, data.source "prepared" without data.path.
Not covered: data.packing on a dataset older than format version 2 (no such dataset is
made any more).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from parallel3d.cli import main
from parallel3d.config import load_config
from parallel3d.data.prepare import prepare_data
from parallel3d.errors import UserError
from parallel3d.model_config import resolve_model_config
from parallel3d.train.data import check_data
from parallel3d.train.setup import check_job
from parallel3d.train.worker import run_worker

from data_inputs import make_mixed_inputs, make_tokenizer

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
RECIPE = str(ROOT / "recipes" / "finetune_hf.toml")
CONTEXT = 64


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A random HF Llama (context 64, its own tokenizer of 300 tokens), a copy whose
    tokenizer has two ids swapped, and ~400 kB of text prepared with the first (10% of the
    documents held out)."""
    root = tmp_path_factory.mktemp("start")
    model = root / "model"
    make_tokenizer(model, 300)
    cfg = transformers.LlamaConfig(vocab_size=301, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=CONTEXT, tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(model)
    other = root / "other"
    shutil.copytree(model, other)
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = [k for k, v in vocab.items() if v in (100, 101)]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other / "tokenizer.json").write_text(json.dumps(tok))
    make_mixed_inputs(root / "text", 400_000)
    data = _prepare(root, model, "data", 0.1)
    return {"root": root, "model": model, "other": other, "data": data}


def _prepare(root: Path, tokenizer: Path, name: str, val_fraction: float) -> Path:
    out = root / name
    prepare_data([str(root / "text")], tokenizer, out, workers=1, val_fraction=val_fraction,
                 shard_tokens=50_000, progress=False, overwrite=True)
    return out


def _base(s, tmp_path) -> list[str]:
    return [f"--model.hf_checkpoint={s['model']}", f"--data.path={s['data']}", f"--run.dir={tmp_path / 'run'}",
            "--parallel.dp=1", "--launch.nproc=1", "--train.seq_len=32", "--train.global_batch=8",
            "--train.micro_batch=4", "--train.steps=2", "--checkpoint.export_hf=", "--eval.interval=1"]


def _error(capsys, argv) -> str:
    capsys.readouterr()
    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert err.startswith("parallel3d: error: ") and len(err.splitlines()) == 1, err
    return err


CASES = {
    "validation split": (["--eval.batches=100"], "the validation split holds"),
    "seq_len over context": (["--train.seq_len=128"], "exceeds the model's context of 64 tokens"),
    "not a dataset": (["--data.path={root}/nothing"], "nothing' "),
    "vocabulary": (["--data.path={root}/big_vocab"], "the dataset's vocabulary (700) exceeds"),
    "tokenizer": (["--model.hf_checkpoint={other}"], "was tokenized with another tokenizer"),
    "run dir": (["--run.dir={root}/file/run"], "is a file"),
    "resume": (["--checkpoint.resume={root}/no_checkpoint"], "checkpoint.resume"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_dry_run_fails_as_the_run_does(case, setup, tmp_path, capsys):
    s = setup
    if case == "vocabulary" and not (s["root"] / "big_vocab").exists():
        _prepare(s["root"], make_tokenizer(s["root"] / "tok700", 700), "big_vocab", 0.1)
    (s["root"] / "file").write_text("x")
    extra, needle = CASES[case]
    argv = ["train", RECIPE, *_base(s, tmp_path), *(a.format(root=s["root"], other=s["other"]) for a in extra)]
    dry = _error(capsys, [*argv, "--dry-run"])
    assert needle in dry, dry
    assert _error(capsys, argv) == dry
    # a launched worker's own checks (the launching process has run them above)
    cfg = load_config(RECIPE, argv[2:])
    assert run_worker(cfg.to_dict()) == 2
    assert capsys.readouterr().err.strip() == dry


def test_a_green_dry_run_says_how_often_the_data_is_read(setup, tmp_path, capsys):
    capsys.readouterr()
    assert main(["train", RECIPE, *_base(setup, tmp_path), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"data: checked: [\d,]+ training tokens \([\d,]+ sequences\), [\d,]+ held out; "
                     r"the run reads \d+% of the training split", out), out
    assert main(["train", RECIPE, *_base(setup, tmp_path), "--train.steps=2000", "--dry-run"]) == 0
    assert re.search(r"passes over the training split \d+\.\d times \(data repeats\)", capsys.readouterr().out)


# -- suggestions --------------------------------------------------------------------------

OVERRIDE = re.compile(r"--([a-z_]+\.[a-z_]+)=([^\s,;:]+)")
PREPARE = re.compile(r"--val-fraction ([0-9.]+)")


def _checks(argv: list[str]) -> None:
    """check_job, then the data checks: what the dry run and the run check."""
    cfg = load_config(RECIPE, argv)
    model = resolve_model_config(cfg.model)
    check_job(cfg, model, 1)
    check_data(cfg, model.vocab_size)


def _message(argv) -> str:
    with pytest.raises(UserError) as e:
        _checks(argv)
    return str(e.value)


def _apply(argv: list[str], message: str) -> list[list[str]]:
    """Each --key=value the message suggests, one at a time: argv with that change."""
    return [[a for a in argv if not a.startswith(f"--{key}=")] + [f"--{key}={value}"]
            for key, value in OVERRIDE.findall(message)]


def test_the_validation_split_suggestions_each_work(setup, tmp_path):
    s = setup
    argv = _base(s, tmp_path) + ["--eval.batches=100"]
    message = _message(argv)
    assert "data.val_fraction" not in message  # it does not apply to prepared data
    changes = _apply(argv, message)
    assert [c[-1].split("=")[0] for c in changes] == ["--eval.batches", "--eval.interval"], message
    for changed in changes:
        _checks(changed)
    (fraction,) = PREPARE.findall(message)
    again = _prepare(s["root"], s["model"], "data_more_val", float(fraction))
    _checks([a for a in argv if not a.startswith("--data.path")] + [f"--data.path={again}"])


def test_with_no_held_out_sequence_it_does_not_suggest_fewer_batches(setup, tmp_path):
    s = setup
    none_held = _prepare(s["root"], s["model"], "data_no_val", 0.0)
    argv = _base(s, tmp_path) + [f"--data.path={none_held}"]
    message = _message(argv)
    assert "holds 0 sequences" in message and "eval.batches=" not in message, message
    for changed in _apply(argv, message):
        _checks(changed)
    (fraction,) = PREPARE.findall(message)
    again = _prepare(s["root"], s["model"], "data_some_val", float(fraction))
    _checks([a for a in argv if not a.startswith("--data.path")] + [f"--data.path={again}"])


def test_the_stdlib_corpus_suggests_data_val_fraction(tmp_path):
    from parallel3d.config import config_from_dict

    job = {"model": {"preset": "debug", "vocab_size": 300}, "data": {"max_bytes": 300_000, "vocab_size": 300,
                                                                     "cache_dir": str(tmp_path)},
           "train": {"seq_len": 64, "global_batch": 16, "micro_batch": 16, "steps": 2},
           "eval": {"interval": 1, "batches": 8}}
    cfg = config_from_dict(job)
    with pytest.raises(UserError) as e:
        check_data(cfg, 300)
    message = str(e.value)
    (fraction,) = re.findall(r"--data.val_fraction=([0-9.]+)", message)
    job["data"]["val_fraction"] = float(fraction)
    check_data(config_from_dict(job), 300)


def test_other_data_messages_suggest_what_works(setup, tmp_path):
    s = setup
    base = _base(s, tmp_path)
    # the model's context
    message = _message(base + ["--train.seq_len=128"])
    (change,) = _apply(base + ["--train.seq_len=128"], message)
    _checks(change)
    # data.val_fraction with prepared data: refused, and dropping it works
    message = _message(base + ["--data.val_fraction=0.2"])
    assert "does not apply to a prepared dataset" in message and "drop data.val_fraction" in message
    _checks(base)
    # data.source "prepared" without data.path: pass one made by prepare-data
    no_path = [a for a in base if not a.startswith("--data.path")]
    message = _message(no_path)
    assert "--data.path=DATA_DIR" in message and f"--tokenizer {s['model']}" in message
    _checks(no_path + [f"--data.path={s['data']}"])
    # another tokenizer: prepare again with the model's
    message = _message(base + [f"--model.hf_checkpoint={s['other']}"])
    assert f"prepare the data again with --tokenizer {s['other']}" in message
    again = _prepare(s["root"], s["other"], "data_other", 0.1)
    _checks(base + [f"--model.hf_checkpoint={s['other']}", f"--data.path={again}"])


def test_a_preset_model_with_a_larger_vocabulary_suggests_model_vocab_size(setup, tmp_path):
    argv = [f"--data.path={setup['data']}", "--model.preset=debug", "--model.vocab_size=200",
            "--train.seq_len=32", "--train.global_batch=8", "--train.micro_batch=8", "--parallel.dp=1",
            "--launch.nproc=1", "--eval.interval=0"]
    message = _message(argv)
    (change,) = [c for c in _apply(argv, message) if c[-1].startswith("--model.vocab_size")]
    _checks(change)


def test_the_banner_and_the_summary_say_when_data_repeats(setup, tmp_path):
    """Issue 37 point 5: epochs = steps * global_batch / the training split's sequences
    (here 2000 x 8 over ~8,000 sequences of 32 tokens); the banner's lines wrap at 120."""
    from parallel3d.cli import _banner, _summary

    cfg = load_config(RECIPE, _base(setup, tmp_path) + ["--train.steps=2000", "--eval.interval=0"])
    model = resolve_model_config(cfg.model)
    facts = check_data(cfg, model.vocab_size)
    epochs = 2000 * 8 / facts.train_samples
    assert epochs > 1
    lines = _banner(cfg, model, 1, "gloo", facts)
    first = next(i for i, line in enumerate(lines) if line.startswith("  data      "))
    last = next(i for i, line in enumerate(lines) if line.startswith("  run dir   "))
    assert last - first >= 2 and max(len(line) for line in lines[first:last]) <= 120, lines
    text = " ".join(line.strip() for line in lines)
    assert (f"{facts.train_tokens:,} training tokens ({facts.train_samples:,} sequences): the run passes over "
            f"the training split {epochs:.1f} times (data repeats)") in text, text
    run = Path(cfg.run.dir)
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.0, "tokens_per_s": 1.0,
                                                    "step_time_s": 0.1}) + "\n")
    done = _summary(cfg, model, 1.0)[0]
    assert done.startswith("done: ") and done.endswith(f"; {epochs:.1f} passes over the training split "
                                                       "(data repeated)"), done


def test_the_finetune_recipe_says_which_sizes_a_model_or_dataset_may_need_changed(setup, tmp_path):
    """Issue 37 point 4: its seq_len 4096 is refused for a shorter-context model, and its
    header says so with the override the error gives (here for the 64-token test model)."""
    header = Path(RECIPE).read_text().split("[model]")[0]
    assert "Qwen3" in header and "nothing else needs to change" not in header
    assert "for\n# a 2048-context model add --train.seq_len=2048" in header
    argv = [a for a in _base(setup, tmp_path) if not a.startswith("--train.seq_len")]
    message = _message(argv)  # the recipe's own seq_len 4096
    assert message.endswith(f"set --train.seq_len={CONTEXT}"), message
    _checks(argv + [f"--train.seq_len={CONTEXT}"])
