"""``launch.host_memory``: what glibc does with a CPU step's freed buffers. Counted in page
faults and resident memory of a fresh process (the allocator's settings are per process,
and set once), not in time."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from parallel3d.config import config_from_dict
from parallel3d.errors import UserError

from helpers import tiny_job

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")

_PROBE = r"""
import json, resource, sys
import torch
from parallel3d.distributed import set_host_allocator

def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

def resident_kib():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])

applied = set_host_allocator(sys.argv[1])
keep = torch.ones(64, 1024)  # the heap in use, as a step's would be
out = {"applied": applied}
# a step's temporaries under 4 MiB: written, then all freed; the first steps grow the heap
sizes = [2**20, 2 * 2**20, 512 * 2**10, 3 * 2**20]
def step():
    xs = [torch.ones(n // 4) for n in sizes]
    del xs
for _ in range(3):
    step()
before = faults()
for _ in range(20):
    step()
out["faults_per_step"] = (faults() - before) / 20
out["pages_per_step"] = sum(sizes) // 4096
n = 8 * 2**20 // 4  # a buffer from 4 MiB: mapped, and returned when freed
x = torch.ones(n)
held = resident_kib()
del x
out["returned_8mib_kib"] = held - resident_kib()
print(json.dumps(out))
"""


def _probe(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_fast_reuses_small_buffers_and_returns_large_ones_tight_returns_both():
    fast, tight, libc = _probe("fast"), _probe("tight"), _probe("libc")
    assert fast["applied"] and tight["applied"] and not libc["applied"]
    pages = tight["pages_per_step"]
    # tight: each temporary is mapped afresh at every step, every page faulted again
    assert tight["faults_per_step"] >= pages, tight
    # fast: once the first steps have grown the heap, the temporaries reuse its freed blocks
    assert fast["faults_per_step"] < 0.1 * pages, fast
    # from 4 MiB both map the buffer: it goes back to the system when freed
    assert fast["returned_8mib_kib"] >= 8192 and tight["returned_8mib_kib"] >= 8192


def test_an_unknown_host_memory_mode_is_refused_naming_the_choices(corpus_dir, tmp_path):
    with pytest.raises(UserError, match="launch.host_memory 'lean' is not supported: use fast, tight, libc"):
        config_from_dict(tiny_job(corpus_dir, str(tmp_path), launch={"host_memory": "lean"}))
