"""Loading executes nothing and reads nothing outside the folder it was given.

Every row takes a real checkpoint (a parallel3d checkpoint of two training steps, its
Hugging Face export, or a DeepSpeed-format folder), plants something in it, and runs the
command line (``convert`` or ``train`` resuming / fine-tuning from it) in this process:

- a pickle payload where metadata or weights are read: those rows, with their control,
  are tests/test_safe_loading_pickles.py's, run by this module's checkpoints and guard.
- names in an index that leave the folder (``../``, absolute paths, a symlink, a
  ``latest`` pointing up). Their target is a FIFO outside the folder: opening it to read
  would block until a writer comes, so the command runs in a thread and a watchdog checks
  it finishes; an audit hook records every file Python opens, and none may lie outside.

Each must exit with status 2 and one line naming the file and what is refused.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import threading
from pathlib import Path

import pytest

from parallel3d.cli import main
from parallel3d.config import config_from_dict
from parallel3d.topology import Topology
from parallel3d.train.trainer import Trainer

from helpers import job_args, tiny_job, torch_threads

# -- what a row opens ------------------------------------------------------------------------

_OPENED: list[str] | None = None  # paths Python opens while a row runs


def _audit(event: str, args) -> None:
    if _OPENED is not None and event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        _OPENED.append(os.path.realpath(os.fsdecode(args[0])))


sys.addaudithook(_audit)  # hooks cannot be removed; this one only records while _OPENED is set


# -- the checkpoints the rows spoil ----------------------------------------------------------

def _job(corpus_dir: str, run_dir: Path, **sections) -> dict:
    return tiny_job(corpus_dir, str(run_dir), **{"train": {"steps": 2}, "checkpoint": {"interval": 2},
                                                 **sections})


@pytest.fixture(scope="module")
def originals(corpus_dir, tmp_path_factory):
    """A parallel3d checkpoint after two steps, and its Hugging Face export."""
    root = tmp_path_factory.mktemp("originals")
    job = _job(corpus_dir, root / "run", checkpoint={"interval": 2, "export_hf": str(root / "hf")})
    with torch_threads(1):
        Trainer(config_from_dict(job), Topology.single(), log=False).fit()
    return {"ckpt": root / "run" / "checkpoints" / "step_00000002", "hf": root / "hf"}


def _p3d(originals, tmp: Path) -> Path:
    """A checkpoints folder (``latest`` + ``step_00000002``) of our own to spoil."""
    root = tmp / "checkpoints"
    shutil.copytree(originals["ckpt"], root / "step_00000002")
    (root / "latest").write_text("step_00000002\n")
    return root


def _index(root: Path) -> tuple[Path, dict]:
    path = root / "step_00000002" / "index.json"
    return path, json.loads(path.read_text())


# -- the rows: (name, build(originals, tmp, marker, outside) -> argv, needle) -------------------

def _index_file_name(name_of):
    """Every piece and file record of rank 0's safetensors renamed to ``name_of(outside)``."""
    def build(o, tmp, marker, outside):
        root = _p3d(o, tmp)
        path, index = _index(root)
        bad = name_of(outside)
        # the record matches the target (a FIFO: 0 bytes), so only the name check stands
        # between the reader and the outside file
        del index["files"]["rank_00000.safetensors"]
        index["files"][bad] = {"size": 0, "sha256": hashlib.sha256(b"").hexdigest()}
        for entry in index["tensors"].values():
            for piece in entry["pieces"]:
                if piece["file"] == "rank_00000.safetensors":
                    piece["file"] = bad
        path.write_text(json.dumps(index))
        return ["convert", str(root), str(tmp / "out"), "--to", "hf"]
    return build


def _rank_json_outside(o, tmp, marker, outside):
    root = _p3d(o, tmp)
    path, index = _index(root)
    index["ranks"]["0"] = os.path.relpath(outside / "rank.json", root / "step_00000002")
    path.write_text(json.dumps(index))
    return ["train", *TRAIN_ARGS, f"--checkpoint.resume={root}"]


def _symlink_out(o, tmp, marker, outside):
    root = _p3d(o, tmp)
    link = root / "step_00000002" / "rank_00000.safetensors"
    link.unlink()
    link.symlink_to(outside / "weights.safetensors")
    path, index = _index(root)  # a record that matches the target (a FIFO: 0 bytes)
    index["files"]["rank_00000.safetensors"] = {"size": 0, "sha256": hashlib.sha256(b"").hexdigest()}
    path.write_text(json.dumps(index))
    return ["convert", str(root), str(tmp / "out"), "--to", "hf"]


def _latest_up(o, tmp, marker, outside):
    root = _p3d(o, tmp)
    (root / "latest").write_text(os.path.relpath(outside, root) + "\n")
    return ["convert", str(root), str(tmp / "out"), "--to", "hf"]


def _hf_index_outside(o, tmp, marker, outside):
    hf = tmp / "hf"
    shutil.copytree(o["hf"], hf)
    (hf / "model.safetensors").unlink()
    target = os.path.relpath(outside / "weights.safetensors", hf)
    (hf / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"model.embed_tokens.weight": target}}))
    return ["convert", str(hf), str(tmp / "out"), "--to", "parallel3d"]


PATHS = [
    ("index-dotdot", _index_file_name(lambda out: "../../outside/weights.safetensors"),
     "only plain file names inside the checkpoint folder"),
    ("index-absolute", _index_file_name(lambda out: str(out / "weights.safetensors")),
     "only plain file names inside the checkpoint folder"),
    ("rank-json-dotdot", _rank_json_outside, "only plain file names inside the checkpoint folder"),
    ("symlink-out", _symlink_out, "is a link out of the checkpoint folder"),
    ("latest-dotdot", _latest_up, "only plain file names inside the checkpoint folder"),
    ("hf-index-dotdot", _hf_index_outside, "only plain file names inside the folder"),
]
TRAIN_ARGS: list[str] = []  # the tiny job's overrides, set by the fixture below


@pytest.fixture(autouse=True)
def train_args(corpus_dir, tmp_path):
    job = _job(corpus_dir, tmp_path / "run", launch={"nproc": 1, "threads_per_proc": 1},
               parallel={"tp": 1, "pp": 1, "dp": 1, "zero": 0, "sequence_parallel": False})
    TRAIN_ARGS[:] = job_args(job)
    yield


def _outside(tmp: Path) -> Path:
    """A folder beside the checkpoint whose every file is a FIFO: a read blocks."""
    outside = tmp / "outside"
    outside.mkdir()
    for name in ("weights.safetensors", "rank.json", "index.json"):
        os.mkfifo(outside / name)
    return outside


def _run_guarded(argv: list[str], outside: Path, timeout: float = 30) -> tuple[int, list[str]]:
    """``main(argv)`` in a thread; returns (status, paths Python opened). Fails if it does
    not finish: something is blocked opening a FIFO (then unblocked by opening its other end)."""
    global _OPENED
    result, opened = {}, []

    def target():
        try:
            result["code"] = main(argv)
        except SystemExit as e:
            result["code"] = e.code
        except BaseException as e:  # noqa: BLE001 - reported below with the row
            result["error"] = e

    _OPENED = opened
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout)
    _OPENED = None
    if thread.is_alive():
        for fifo in outside.iterdir():
            try:
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # EOF to a blocked reader
            except OSError:
                pass
        thread.join(10)
        pytest.fail(f"{argv[0]} did not finish in {timeout} s: it opened a file outside the folder")
    if "error" in result:
        raise result["error"]
    return result["code"], opened


def _check_refused(name, build, needle, originals, tmp_path, capsys):
    marker, outside = tmp_path / "MARKER", _outside(tmp_path)
    argv = build(originals, tmp_path, marker, outside)
    capsys.readouterr()
    code, opened = _run_guarded(argv, outside)
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2, (code, err)
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in err, err
    assert not marker.exists(), f"{name}: the payload ran"
    out_of_bounds = [p for p in opened if Path(p).is_relative_to(outside.resolve())]
    assert not out_of_bounds, f"{name}: opened {out_of_bounds}"
    assert not (tmp_path / "out").exists(), f"{name}: wrote output from a refused source"


@pytest.mark.parametrize("name,build,needle", PATHS, ids=[r[0] for r in PATHS])
def test_paths_out_of_the_folder_are_refused_unopened(name, build, needle, originals, tmp_path, capsys):
    _check_refused(name, build, needle, originals, tmp_path, capsys)


# -- the controls: the guard sees opens, a clean folder loads --------------------------------------


def test_controls_the_guard_catches_a_read_outside(tmp_path):
    """The audit hook records a Python open of a file outside; a blocking open of the FIFO
    is caught by the watchdog (the row then fails, as a real escape would)."""
    outside = _outside(tmp_path)
    plain = outside / "plain.txt"
    plain.write_text("x")
    global _OPENED
    _OPENED = seen = []
    plain.read_text()
    _OPENED = None
    assert str(plain.resolve()) in seen
    fifo = outside / "weights.safetensors"
    opened = threading.Thread(target=lambda: open(fifo, "rb").close(), daemon=True)
    opened.start()
    opened.join(0.5)
    assert opened.is_alive()  # blocked in open(), as the guarded command would be
    os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    opened.join(5)
    assert not opened.is_alive()


def test_controls_the_unspoiled_originals_convert(originals, tmp_path, capsys):
    root = _p3d(originals, tmp_path)
    assert main(["convert", str(root), str(tmp_path / "hf"), "--to", "hf"]) == 0
    assert main(["convert", str(originals["hf"]), str(tmp_path / "p3d"), "--to", "parallel3d"]) == 0
