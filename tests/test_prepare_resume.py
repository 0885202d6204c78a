"""prepare-data killed half-way and run again (issue 34, acceptance 3): it continues after
the last finished shard without writing the finished shards again, and the dataset equals
an uninterrupted preparation byte for byte."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from parallel3d.data.prepare import prepare_data
from parallel3d.data.resume import STATE
from parallel3d.reliability.watch import _process_gone

from data_inputs import make_mixed_inputs
from helpers import spawned_children

OPTIONS = dict(val_fraction=0.05, shard_tokens=20_000, chunk_bytes=1 << 16, progress=False)


def _files(d: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted(d.iterdir()) if f.is_file()}


def _kill_after_shards(args: list, out: Path, shards: int) -> None:
    """Run prepare-data in a child; SIGKILL it once its saved state holds ``shards``
    finished training shards."""
    code = ("import sys, json; from pathlib import Path; from parallel3d.data.prepare import prepare_data; "
            "a = json.loads(sys.argv[1]); prepare_data(a['inputs'], a['tok'], a['out'], workers=1, **a['opts'])")
    child = subprocess.Popen([sys.executable, "-c", code, json.dumps(args)])
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline and child.poll() is None:
            try:
                state = json.loads((out / STATE).read_text())
            except (OSError, json.JSONDecodeError):
                state = None
            if state and len(state["writers"]["train"]["tokens"]["shards"]) >= shards:
                child.send_signal(signal.SIGKILL)
                break
            time.sleep(0.01)
    finally:
        child.wait()
    assert child.returncode == -signal.SIGKILL, "prepare-data finished before it was killed"


def test_a_killed_preparation_resumes_at_its_last_shard_and_equals_an_uninterrupted_one(prepared_dir, tmp_path):
    tok = Path(prepared_dir) / "tokenizer"
    make_mixed_inputs(tmp_path / "in", 3_000_000)
    inputs = [str(tmp_path / "in")]
    prepare_data(inputs, tok, tmp_path / "whole", workers=1, **OPTIONS)

    out = tmp_path / "killed"
    _kill_after_shards({"inputs": inputs, "tok": str(tok), "out": str(out), "opts": OPTIONS}, out, shards=5)
    assert not (out / "index.json").exists()
    state = json.loads((out / STATE).read_text())
    finished = [s["file"] for w in state["writers"].values() for part in w.values()
                if isinstance(part, dict) for s in part["shards"]]
    before = {f: (out / f).stat() for f in finished}

    report = prepare_data(inputs, tok, out, workers=2, **OPTIONS)  # other workers: the same bytes
    assert 0 < report.resumed_bytes < report.disk_bytes
    for f, st in before.items():  # kept, not written again
        now = (out / f).stat()
        assert (now.st_ino, now.st_mtime_ns) == (st.st_ino, st.st_mtime_ns), f
    assert not (out / STATE).exists()
    got, want = _files(out), _files(tmp_path / "whole")
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name] == want[name], f"{name} differs from the uninterrupted preparation"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_a_killed_preparation_leaves_no_worker_running_and_no_traceback(prepared_dir, tmp_path):
    """prepare-data with 2 worker processes, SIGKILLed mid-run: its workers end within
    seconds (they get SIGTERM when their parent dies; before, they printed BrokenPipe
    tracebacks as they found the pipe gone) and print nothing."""
    make_mixed_inputs(tmp_path / "in", 3_000_000)
    out = tmp_path / "killed"
    args = {"inputs": [str(tmp_path / "in")], "tok": str(Path(prepared_dir) / "tokenizer"), "out": str(out),
            "opts": OPTIONS}
    code = ("import sys, json; from parallel3d.data.prepare import prepare_data; "
            "a = json.loads(sys.argv[1]); prepare_data(a['inputs'], a['tok'], a['out'], workers=2, **a['opts'])")
    err = tmp_path / "stderr"
    with open(err, "wb") as stderr:
        child = subprocess.Popen([sys.executable, "-c", code, json.dumps(args)], stderr=stderr)
    workers: list[int] = []
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline and child.poll() is None:
            workers = spawned_children(child.pid)
            if len(workers) >= 2 and (out / STATE).exists():  # the pool runs, a shard is done
                break
            time.sleep(0.05)
        child.send_signal(signal.SIGKILL)
    finally:
        child.wait()
    assert child.returncode == -signal.SIGKILL and len(workers) >= 2, (child.returncode, workers)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not all(_process_gone(w) for w in workers):
        time.sleep(0.05)
    assert all(_process_gone(w) for w in workers), "workers outlived the killed prepare-data"
    time.sleep(0.5)  # (anything they would print after)
    assert "Traceback" not in err.read_text(errors="replace"), err.read_text(errors="replace")[-2000:]


def test_other_options_start_over(prepared_dir, tmp_path, capsys):
    tok = Path(prepared_dir) / "tokenizer"
    make_mixed_inputs(tmp_path / "in", 3_000_000)
    inputs, out = [str(tmp_path / "in")], tmp_path / "killed"
    _kill_after_shards({"inputs": inputs, "tok": str(tok), "out": str(out), "opts": OPTIONS}, out, shards=2)
    report = prepare_data(inputs, tok, out, workers=1, **{**OPTIONS, "shard_tokens": 30_000, "progress": True})
    assert report.resumed_bytes == 0
    assert "not resuming the interrupted run" in capsys.readouterr().err
    names = {f.name for f in out.iterdir()}
    assert not any(n.endswith(".partial") for n in names) and STATE not in names
    expected = prepare_data(inputs, tok, tmp_path / "fresh", workers=1, **{**OPTIONS, "shard_tokens": 30_000})
    assert _files(out) == _files(tmp_path / "fresh") and expected.resumed_bytes == 0


@pytest.mark.parametrize("done, total, line", [
    (50e6, 200e6, "prepare-data: 25% (50.0 of 200.0 MB), 5.00 MB/s, 100 tokens/s, 0m30s left"),
])
def test_the_progress_line_has_the_rate_and_the_time_left(done, total, line):
    from parallel3d.data.progress import Progress

    p = Progress(int(total), enabled=False)
    p.done, p.tokens = int(done), 1000
    assert p.line(p.t0 + 10.0) == line
    p.resumed = int(done) // 2  # a resumed run: its own bytes only
    assert "2.50 MB/s" in p.line(p.t0 + 10.0) and "1m00s left" in p.line(p.t0 + 10.0)
