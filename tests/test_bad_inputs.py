"""Bad input at every entry point: exit status 2, one line on stderr, no traceback, fast.

Each row is ``(subcommand argv, files to create, expected substring)``; ``{tmp}`` in an
argument is the row's temporary directory and ``{corpus}`` the session's corpus cache.
``files`` maps a name under ``{tmp}`` to bytes (a file), ``"dir"`` (a directory) or
``("link", target)`` (a symlink); ``{tokenizer}`` is the corpus's tokenizer folder. Rows
for the other subcommands (convert, prepare-data, report, plan) are in the same table with
their own argv. No row may change the files it was given (a refused ``convert`` keeps a
non-empty DST as it was).

The rows call ``parallel3d.cli.main`` in-process (the console script is
``sys.exit(main())``), so a traceback would surface as an exception and fail the row;
``test_bad_input_in_a_fresh_process`` runs a few rows through a real process as well.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from parallel3d.cli import main

from helpers import run_counting_cpu

# Added to each train row unless the row sets the key: one step, a run directory of its own.
BASE = {"--train.steps": "1", "--run.dir": "{tmp}/run"}
# Rows on the default recipe also pin its layout to plain data parallelism over 2 ranks,
# so the expected messages do not depend on what the default recipe happens to choose.
BASE_LAYOUT = {"--parallel.tp": "1", "--parallel.pp": "1", "--parallel.dp": "2",
               "--launch.nproc": "2", "--parallel.sequence_parallel": "false",
               "--parallel.zero": "0"}

ROWS = [
    # -- config keys and types
    ("unknown-key", ["train", "--train.lrr=1"], {}, "unknown config key 'train.lrr' (did you mean 'train.lr'?)"),
    ("unknown-section", ["train", "--trian.lr=1"], {}, "unknown config key 'trian' (did you mean 'train'?)"),
    ("wrong-type-str", ["train", "--train.seq_len=abc"], {}, "train.seq_len expects int, got 'abc'"),
    ("wrong-type-float", ["train", "--train.micro_batch=1.5"], {}, "train.micro_batch expects int, got 1.5"),
    ("bool-for-int", ["train", "--parallel.tp=true"], {}, "parallel.tp expects int, got True"),
    ("wrong-list", ["train", "--parallel.pp_layers=[1,\"a\"]"], {}, "parallel.pp_layers expects list"),
    ("section-not-table", ["train", "{tmp}/r.toml"], {"r.toml": b"parallel = 2\n"},
     "'parallel' must be a table of keys"),
    ("override-without-section", ["train", "--steps=2"], {}, "unexpected argument '--steps=2'"),
    ("override-no-value", ["train", "--train.lr"], {}, "'--train.lr' needs a value"),
    ("stray-argument", ["train", "{tmp}/r.toml", "extra"], {"r.toml": b""}, "unexpected argument 'extra'"),
    ("unknown-subcommand", ["trian"], {}, "invalid choice: 'trian'"),
    # -- layouts
    ("world-size", ["train", "--parallel.tp=2", "--parallel.dp=2", "--launch.nproc=2"], {},
     "world size 2 != tp*cp*pp*dp = 2*1*1*2 = 4"),
    ("negative-degree", ["train", "--parallel.dp=-1", "--launch.nproc=2"], {}, "parallel.dp must be a positive integer, got -1"),
    ("heads-vs-tp", ["train", "--parallel.tp=3", "--parallel.dp=1", "--launch.nproc=3"], {},
     "model.n_heads 4 is not divisible by parallel.tp 3"),
    ("pp-vs-layers", ["train", "--parallel.pp=8", "--parallel.dp=1", "--launch.nproc=8"], {},
     "model.n_layers 4 is fewer than parallel.pp 8"),
    ("global-batch", ["train", "--train.global_batch=10", "--train.micro_batch=4"], {},
     "train.global_batch 10 is not divisible by train.micro_batch 4 * parallel.dp 2 = 8"),
    ("micro-batches-vs-pp", ["train", "--parallel.pp=2", "--parallel.dp=1", "--train.global_batch=4",
                             "--train.micro_batch=4"], {}, "is fewer than parallel.pp 2"),
    ("schedule-typo", ["train", "--parallel.schedule=1f1c"], {}, "did you mean '1f1b'"),
    ("interleaved-needs-chunks", ["train", "--parallel.schedule=interleaved", "--parallel.pp=2",
                                  "--parallel.dp=1"], {}, "needs parallel.pp >= 2 and parallel.virtual_stages >= 2"),
    ("virtual-without-interleaved", ["train", "--parallel.virtual_stages=2"], {},
     "parallel.virtual_stages 2 needs parallel.schedule 'interleaved'"),
    ("pp-layers-sum", ["train", "--parallel.pp=2", "--parallel.dp=1", "--parallel.pp_layers=[1,1]"], {},
     "parallel.pp_layers"),
    ("sequence-parallel-seq", ["train", "--parallel.tp=2", "--parallel.dp=1", "--parallel.sequence_parallel=true",
                               "--train.seq_len=33"], {}, "train.seq_len 33 is not divisible by parallel.tp 2"),
    ("zero-4", ["train", "--parallel.zero=4"], {}, "parallel.zero 4 is not supported: use 0, 1, 2, 3"),
    ("offload-without-zero", ["train", "--parallel.offload_optimizer=true"], {}, "needs the sharded optimizer"),
    ("bucket-size", ["train", "--parallel.bucket_mb=0"], {}, "parallel.bucket_mb must be positive"),
    ("linear-backend", ["train", "--parallel.linear_backend=cutlass"], {}, "parallel.linear_backend 'cutlass'"),
    # -- train / model / reliability values
    ("negative-lr", ["train", "--train.lr=-1"], {}, "train.lr must be positive, got -1"),
    ("dtype", ["train", "--train.dtype=fp8"], {}, "train.dtype 'fp8' is not supported"),
    ("recompute", ["train", "--train.recompute=some"], {}, "train.recompute 'some' is not supported"),
    ("negative-clip", ["train", "--train.grad_clip=-1"], {}, "train.grad_clip must be >= 0"),
    ("seq-too-long", ["train", "--train.seq_len=100000"], {}, "exceeds the model's context of"),
    ("model-preset", ["train", "--model.preset=huge"], {}, "unknown model.preset 'huge'"),
    ("on-nonfinite", ["train", "--reliability.on_nonfinite=ignore"], {}, "reliability.on_nonfinite 'ignore'"),
    ("comm-timeout", ["train", "--reliability.comm_timeout_s=0"], {}, "reliability.comm_timeout_s must be positive"),
    ("spike-factor", ["train", "--reliability.spike_factor=0.5"], {}, "reliability.spike_factor must be above 1"),
    # -- launch / data / run values and files
    ("negative-nproc", ["train", "--launch.nproc=-1"], {}, "launch.nproc must be at least 1, got -1"),
    ("backend", ["train", "--launch.backend=mpi"], {}, "launch.backend 'mpi' is not supported"),
    ("nccl-on-cpu", ["train", "--launch.backend=nccl", "--launch.nproc=1", "--parallel.dp=1"], {},
     "launch.backend 'nccl' needs CUDA devices"),
    ("data-source", ["train", "--data.source=web", "--launch.nproc=1", "--parallel.dp=1"], {},
     "data.source 'web' is not supported"),
    ("data-vocab", ["train", "--data.vocab_size=100", "--launch.nproc=1", "--parallel.dp=1",
                    "--data.cache_dir={tmp}/cache"], {}, "data.vocab_size 100 is too small"),
    ("cache-dir-is-file", ["train", "--data.cache_dir={tmp}/f"], {"f": b"x"}, "data.cache_dir '{tmp}/f' is a file"),
    ("run-dir-under-file", ["train", "--run.dir={tmp}/f/run"], {"f": b"x"}, "'{tmp}/f' is a file"),
    ("tokenizer-vocab-exceeds-model", ["train", "--model.vocab_size=300", "--data.vocab_size=512",
                                       "--data.max_bytes=1000000", "--data.cache_dir={corpus}"], {},
     "the dataset's vocabulary (512) exceeds model.vocab_size 300"),
    # -- recipe files
    ("recipe-missing", ["train", "{tmp}/nope.toml"], {}, "recipe '{tmp}/nope.toml' not found"),
    ("recipe-directory", ["train", "{tmp}/d"], {"d": "dir"}, "is a directory"),
    ("recipe-broken-link", ["train", "{tmp}/l.toml"], {"l.toml": ("link", "/nonexistent/x.toml")}, "not found"),
    ("recipe-invalid-toml", ["train", "{tmp}/r.toml"], {"r.toml": b"[train\nlr = 1\n"}, "is not valid TOML"),
    ("recipe-not-utf8", ["train", "{tmp}/r.toml"], {"r.toml": b'x = "\xff"\n'}, "is not UTF-8 text"),
    ("recipe-unknown-key", ["train", "{tmp}/r.toml"], {"r.toml": b"[train]\nstpes = 3\n"},
     "unknown config key 'train.stpes' (did you mean 'train.steps'?)"),
    ("recipe-wrong-type", ["train", "{tmp}/r.toml"], {"r.toml": b"[parallel]\ntp = \"two\"\n"},
     "parallel.tp expects int, got 'two'"),
]


# -- the other entry points: a minimal Llama config.json and a few made-up ones
LLAMA = json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512,
                    "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                    "num_key_value_heads": 2, "intermediate_size": 160}).encode()
GPT2 = json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": 64}).encode()
REMOTE = json.dumps({**json.loads(LLAMA), "auto_map": {"AutoModelForCausalLM": "modeling_x.X"}}).encode()


def _plan(*extra: str, **options: str) -> list[str]:
    """``plan`` of an 8-GPU node; ``options`` replace the defaults (``gpus_per_node=...``)."""
    values = {"gpus": "8", "gpus_per_node": "8", "gpu": "h100-80g", "seq_len": "2048",
              "global_batch": "64", "model": "8b", **options}
    return ["plan", *[a for k, v in values.items() for a in (f"--{k.replace('_', '-')}", v)], *extra]


OTHER_ROWS = [
    # -- convert
    ("convert-missing-source", ["convert", "{tmp}/nope", "{tmp}/out", "--to", "hf"], {},
     "convert: {tmp}/nope is not a folder"),
    ("convert-not-a-checkpoint", ["convert", "{tmp}/src", "{tmp}/out", "--to", "hf"],
     {"src/notes.txt": b"hello"}, "{tmp}/src is neither a Hugging Face folder"),
    ("convert-unsupported-architecture", ["convert", "{tmp}/src", "{tmp}/out", "--to", "parallel3d"],
     {"src/config.json": GPT2}, "unsupported Hugging Face architecture ['GPT2LMHeadModel']"),
    ("convert-remote-code", ["convert", "{tmp}/src", "{tmp}/out", "--to", "parallel3d"],
     {"src/config.json": REMOTE, "src/modeling_x.py": b"raise SystemExit('imported')\n"},
     "parallel3d never runs code from a model folder"),
    ("convert-pickled-bin", ["convert", "{tmp}/src", "{tmp}/out", "--to", "parallel3d"],
     {"src/config.json": LLAMA, "src/pytorch_model.bin": b"\x80\x04."},
     "holds pickled *.bin weights: parallel3d reads only safetensors"),
    ("convert-to-typo", ["convert", "{tmp}/src", "{tmp}/out", "--to", "hff"], {"src": "dir"},
     "argument --to: invalid choice: 'hff'"),
    ("convert-dtype-typo", ["convert", "{tmp}/src", "{tmp}/out", "--to", "hf", "--dtype", "fp8"],
     {"src": "dir"}, "argument --dtype: invalid choice: 'fp8'"),
    ("convert-dst-not-empty", ["convert", "{tmp}/src", "{tmp}/out", "--to", "hf"],
     {"src/config.json": LLAMA, "out/config.json": b"{}", "out/keep.txt": b"precious"},
     "convert: {tmp}/out exists and is not empty: choose a new DST (or --overwrite to replace it)"),
    ("convert-dst-is-file", ["convert", "{tmp}/src", "{tmp}/out", "--to", "parallel3d"],
     {"src/config.json": LLAMA, "out": b"precious"}, "convert: {tmp}/out exists and is a file"),
    ("convert-max-shard", ["convert", "{tmp}/src", "{tmp}/out", "--to", "hf", "--max-shard-gb=abc"],
     {"src": "dir"}, "--max-shard-gb expects a number of GiB, got 'abc'"),
    ("convert-config-missing", ["convert", "{tmp}/src", "{tmp}/out", "--to", "hf", "--config",
                                "{tmp}/nope.json"], {"src": "dir"}, "convert --config '{tmp}/nope.json' is not a file"),
    ("convert-missing-to", ["convert", "{tmp}/src", "{tmp}/out"], {}, "the following arguments are required: --to"),
    # -- prepare-data
    ("prepare-missing-input", ["prepare-data", "{tmp}/nope.txt", "--tokenizer", "{tokenizer}",
                               "--out", "{tmp}/out"], {}, "input '{tmp}/nope.txt' not found"),
    ("prepare-tokenizer-missing", ["prepare-data", "{tmp}/in.txt", "--tokenizer", "{tmp}/tok",
                                   "--out", "{tmp}/out"], {"in.txt": b"hello"}, "tokenizer '{tmp}/tok' not found"),
    ("prepare-tokenizer-without-json", ["prepare-data", "{tmp}/in.txt", "--tokenizer", "{tmp}/tok",
                                        "--out", "{tmp}/out"], {"in.txt": b"hello", "tok": "dir"},
     "tokenizer folder '{tmp}/tok' has no tokenizer.json"),
    ("prepare-out-is-file", ["prepare-data", "{tmp}/in.txt", "--tokenizer", "{tokenizer}",
                             "--out", "{tmp}/f"], {"in.txt": b"hello", "f": b"precious"},
     "--out '{tmp}/f' is a file: give a directory for the dataset"),
    ("prepare-out-under-file", ["prepare-data", "{tmp}/in.txt", "--tokenizer", "{tokenizer}",
                                "--out", "{tmp}/f/data"], {"in.txt": b"hello", "f": b"precious"},
     "--out '{tmp}/f/data' cannot be created: Not a directory"),
    ("prepare-val-fraction", ["prepare-data", "{tmp}/in.txt", "--tokenizer", "{tokenizer}", "--out",
                              "{tmp}/out", "--val-fraction", "2"], {"in.txt": b"hello"},
     "--val-fraction must be in [0, 1), got 2.0"),
    ("prepare-workers", ["prepare-data", "{tmp}/in.txt", "--tokenizer", "{tokenizer}", "--out",
                         "{tmp}/out", "--workers", "0"], {"in.txt": b"hello"}, "--workers must be at least 1, got 0"),
    # -- report
    ("report-missing-run", ["report", "{tmp}/nope"], {}, "{tmp}/nope/metrics.jsonl does not exist"),
    ("report-run-is-file", ["report", "{tmp}/f"], {"f": b"x"}, "'{tmp}/f' is a file"),
    ("report-not-metrics", ["report", "{tmp}/run"], {"run/metrics.jsonl": b"step 1 loss 2\nstep 2\n"},
     "{tmp}/run/metrics.jsonl line 1 is not JSON"),
    ("report-foreign-records", ["report", "{tmp}/run"], {"run/metrics.jsonl": b'{"epoch": 1}\n'},
     "line 1 is not a parallel3d step record"),
    ("report-no-steps", ["report", "{tmp}/run"], {"run/metrics.jsonl": b""}, "metrics.jsonl holds no steps yet"),
    # -- plan
    ("plan-unknown-model", _plan(model="huge"), {}, "--model 'huge' is neither a preset"),
    ("plan-unsupported-architecture", _plan(model="{tmp}/config.json"), {"config.json": GPT2},
     "unsupported Hugging Face architecture ['GPT2LMHeadModel']"),
    ("plan-gpu-typo", _plan(gpu="h99"), {},
     "argument --gpu: invalid choice: 'h99'"),
    ("plan-partial-node", _plan(gpus="12"), {},
     "--gpus 12 is not a whole number of nodes of 8"),
    ("plan-seq-len", _plan(seq_len="0"), {}, "--seq-len must be at least 1, got 0"),
    ("plan-recipe-is-dir", _plan("--write-recipe", "{tmp}/d"), {"d": "dir"},
     "--write-recipe '{tmp}/d' is a directory"),
    ("plan-calibrate-missing", _plan("--calibrate", "{tmp}/run"), {},
     "calibration needs {tmp}/run/metrics.jsonl"),
    ("plan-missing-args", ["plan", "--model", "8b"], {}, "the following arguments are required: --gpus"),
]
ROWS += OTHER_ROWS


def _materialize(tmp_path, files: dict) -> None:
    for name, content in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if content == "dir":
            path.mkdir()
        elif isinstance(content, tuple):
            path.symlink_to(content[1])
        else:
            path.write_bytes(content)


def _fill(text: str, tmp_path, corpus_dir: str) -> str:
    text = text.replace("{tmp}", str(tmp_path)).replace("{corpus}", corpus_dir)
    if "{tokenizer}" in text:  # the session corpus's tokenizer folder
        text = text.replace("{tokenizer}", str(next(Path(corpus_dir).glob("*/tokenizer"))))
    return text


def _untouched(tmp_path, files: dict) -> list[str]:
    """The given files a row changed (none may be: a refused command writes nothing)."""
    return [name for name, content in files.items()
            if isinstance(content, bytes) and (tmp_path / name).read_bytes() != content]


def _argv(argv: list[str], tmp_path, corpus_dir: str) -> list[str]:
    if argv[0] == "train":
        on_default_recipe = not any(not a.startswith("--") for a in argv[1:])
        base = {**BASE, **(BASE_LAYOUT if on_default_recipe else {})}
        argv = argv + [f"{k}={v}" for k, v in base.items()
                       if not any(a.split("=")[0] == k for a in argv)]
    return [_fill(a, tmp_path, corpus_dir) for a in argv]


@pytest.mark.parametrize("name,argv,files,needle", ROWS, ids=[r[0] for r in ROWS])
def test_bad_input(name, argv, files, needle, tmp_path, corpus_dir, capsys):
    _materialize(tmp_path, files)
    argv = _argv(argv, tmp_path, corpus_dir)
    t0 = time.monotonic()
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own errors exit from inside main
        code = e.code
    seconds = time.monotonic() - t0
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2, (code, err)
    assert len(lines) == 1, err
    assert _fill(needle, tmp_path, corpus_dir) in lines[0], err
    assert "Traceback" not in err
    assert seconds < 20, seconds
    assert not _untouched(tmp_path, files)
    if name.startswith("convert-"):
        assert not (tmp_path / "out").is_dir() or sorted(p.name for p in (tmp_path / "out").iterdir()) == \
            sorted(n.split("/", 1)[1] for n in files if n.startswith("out/")), "convert wrote output"


def test_table_is_wide_enough():
    assert len({r[0] for r in ROWS}) == len(ROWS) >= 25
    commands = {r[1][0] for r in ROWS}
    assert {"train", "convert", "prepare-data", "report", "plan"} <= commands, commands


@pytest.mark.parametrize("name", ["recipe-not-utf8", "unknown-subcommand", "cache-dir-is-file",
                                  "convert-dst-not-empty", "convert-unsupported-architecture",
                                  "prepare-out-is-file", "report-not-metrics", "plan-recipe-is-dir"])
def test_bad_input_in_a_fresh_process(name, tmp_path, corpus_dir):
    """The same rows through the console entry point: status, one line, no traceback."""
    _, argv, files, needle = next(r for r in ROWS if r[0] == name)
    _materialize(tmp_path, files)
    argv = _argv(argv, tmp_path, corpus_dir)
    proc, cpu_s = run_counting_cpu([sys.executable, "-m", "parallel3d.cli", *argv], capture_output=True,
                                   text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and _fill(needle, tmp_path, corpus_dir) in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    assert cpu_s < 20, cpu_s  # CPU seconds: the clock's run ten times longer on a loaded machine
    assert not _untouched(tmp_path, files)
