"""Loading unpickles and imports nothing: the pickle rows of tests/test_safe_loading.py.

Each row takes one of that module's real checkpoints (a parallel3d checkpoint of two
training steps, its Hugging Face export, or a DeepSpeed-format folder), plants a pickle
payload where metadata or weights are read (``index.json``, a rank's JSON, ``latest``, a
safetensors file, DeepSpeed's ``.pt``, ``pytorch_model.bin``, a DCP or Megatron file,
and an ``auto_map`` config with a ``modeling_*.py`` beside it), and runs the command line
under that module's guard. Unpickled (or imported), the payload runs ``touch MARKER``;
the positive control shows that it does, so the marker staying absent proves nothing
ran. Each must exit with status 2 and one line naming the file and what is refused.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from parallel3d.checkpoint.safetensors_io import file_sha256

import test_safe_loading
from test_safe_loading import TRAIN_ARGS, _check_refused, _index, _p3d

# that module's fixtures, used here by name: its checkpoints (built once for this module
# too) and the autouse fixture that fills TRAIN_ARGS
originals, train_args = test_safe_loading.originals, test_safe_loading.train_args

# -- what runs code if anything ever unpickles or imports it ---------------------------------


class Payload:
    """Unpickled, calls ``os.system("touch <marker>")``."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


MODELING = "open({marker!r}, 'w').close()  # imported = executed\n"


# -- the checkpoints the rows spoil (made by tests/test_safe_loading.py) ------------------------

def _replace_listed_file(root: Path, name: str, data: bytes) -> None:
    """Put ``data`` in place of a file the index lists, with a matching size and sha256
    (what someone who hands over a whole checkpoint folder can do)."""
    path, index = _index(root)
    (root / "step_00000002" / name).write_bytes(data)
    size, digest = file_sha256(root / "step_00000002" / name)
    index["files"][name] = {"size": size, "sha256": digest}
    path.write_text(json.dumps(index))


def _deepspeed(originals, tmp: Path, payload: bytes) -> Path:
    """A DeepSpeed-format folder (``latest`` -> ``global_step2``) whose model states are
    ``payload``; config.json beside it, as Hugging Face's Trainer saves it."""
    ds = tmp / "ds"
    (ds / "global_step2").mkdir(parents=True)
    (ds / "latest").write_text("global_step2")
    (ds / "global_step2" / "mp_rank_00_model_states.pt").write_bytes(payload)
    shutil.copy(originals["hf"] / "config.json", ds / "config.json")
    return ds


def _torch_bytes(obj) -> bytes:
    import io

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


# -- the rows: (name, build(originals, tmp, marker, outside) -> argv, needle) -------------------

def _index_pickled(protocol):
    def build(o, tmp, marker, outside):
        root = _p3d(o, tmp)
        _index(root)[0].write_bytes(pickle.dumps(Payload(marker), protocol=protocol))
        return ["convert", str(root), str(tmp / "out"), "--to", "hf"]
    return build


def _rank_json_pickled(o, tmp, marker, outside):
    root = _p3d(o, tmp)
    _replace_listed_file(root, "rank_00000.json", pickle.dumps(Payload(marker), protocol=0))
    return ["train", *TRAIN_ARGS, f"--checkpoint.resume={root}"]


def _latest_pickled(o, tmp, marker, outside):
    root = _p3d(o, tmp)
    (root / "latest").write_bytes(pickle.dumps(Payload(marker)))
    return ["train", *TRAIN_ARGS, f"--checkpoint.resume={root}"]


def _safetensors_pickled(o, tmp, marker, outside):
    root = _p3d(o, tmp)
    _replace_listed_file(root, "rank_00000.safetensors", _torch_bytes({"w": Payload(marker)}))
    return ["convert", str(root), str(tmp / "out"), "--to", "hf"]


def _deepspeed_torch_file(o, tmp, marker, outside):
    module = {"model.embed_tokens.weight": torch.zeros(2, 2)}
    ds = _deepspeed(o, tmp, _torch_bytes({"module": module, "global_steps": 2, "extra": Payload(marker)}))
    return ["convert", str(ds), str(tmp / "out"), "--to", "parallel3d"]


def _deepspeed_raw_pickle(o, tmp, marker, outside):
    ds = _deepspeed(o, tmp, pickle.dumps({"module": Payload(marker)}))
    return ["convert", str(ds), str(tmp / "out"), "--to", "hf"]


def _hf_bin(o, tmp, marker, outside):
    hf = tmp / "hf"
    hf.mkdir()
    shutil.copy(o["hf"] / "config.json", hf / "config.json")
    (hf / "pytorch_model.bin").write_bytes(_torch_bytes({"model.embed_tokens.weight": Payload(marker)}))
    return ["convert", str(hf), str(tmp / "out"), "--to", "parallel3d"]


def _hf_bin_finetune(o, tmp, marker, outside):
    _hf_bin(o, tmp, marker, outside)
    return ["train", *TRAIN_ARGS, f"--model.hf_checkpoint={tmp / 'hf'}"]


def _hf_remote_code(o, tmp, marker, outside):
    hf = tmp / "hf"
    shutil.copytree(o["hf"], hf)
    config = json.loads((hf / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "modeling_evil.EvilConfig",
                          "AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}
    (hf / "config.json").write_text(json.dumps(config))
    (hf / "modeling_evil.py").write_text(MODELING.format(marker=str(marker)))
    return ["convert", str(hf), str(tmp / "out"), "--to", "parallel3d"]


def _hf_safetensors_pickled(o, tmp, marker, outside):
    hf = tmp / "hf"
    shutil.copytree(o["hf"], hf)
    (hf / "model.safetensors").write_bytes(pickle.dumps(Payload(marker)))
    return ["convert", str(hf), str(tmp / "out"), "--to", "parallel3d"]


def _dcp_of(o, tmp: Path) -> Path:
    """A torch DCP folder of the originals' weights (parallel3d's DCP writer), config.json inside."""
    from parallel3d.checkpoint.convert import convert

    convert(o["hf"], tmp / "dcp", "dcp", progress=False)
    return tmp / "dcp"


def _dcp_metadata_pickled(o, tmp, marker, outside):
    dcp = _dcp_of(o, tmp)
    (dcp / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    return ["convert", str(dcp), str(tmp / "out"), "--to", "hf"]


def _dcp_chunk_payload(o, tmp, marker, outside):
    """A chunk whose torch.save archive holds the payload, the metadata pointing at it
    (rewritten with torch's own classes, as a writer would)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    dcp = _dcp_of(o, tmp)
    meta = FileSystemReader(str(dcp)).read_metadata()  # trusted: our own file, test side
    index = next(i for i in meta.storage_data if i.fqn == "model.embed_tokens.weight")
    info = meta.storage_data[index]
    archive = _torch_bytes({"w": Payload(marker)})
    path = dcp / info.relative_path
    start = path.stat().st_size
    with open(path, "ab") as f:
        f.write(archive)
    meta.storage_data[index] = _StorageInfo(info.relative_path, start, len(archive))
    (dcp / ".metadata").write_bytes(pickle.dumps(meta))
    return ["convert", str(dcp), str(tmp / "out"), "--to", "parallel3d"]


def _zero3_model_states(o, tmp, marker, outside):
    ds = tmp / "ds" / "global_step2"
    ds.mkdir(parents=True)
    (ds.parent / "latest").write_text("global_step2")
    (ds / "zero_pp_rank_0_mp_rank_00_model_states.pt").write_bytes(
        _torch_bytes({"module": {}, "param_shapes": [], "extra": Payload(marker)}))
    shutil.copy(o["hf"] / "config.json", ds.parent / "config.json")
    return ["convert", str(ds.parent), str(tmp / "out"), "--to", "hf"]


def _megatron_legacy(o, tmp, marker, outside):
    root = tmp / "megatron"
    (root / "iter_0000002" / "mp_rank_00").mkdir(parents=True)
    (root / "latest_checkpointed_iteration.txt").write_text("2")
    (root / "iter_0000002" / "mp_rank_00" / "model_optim_rng.pt").write_bytes(
        _torch_bytes({"model": {}, "args": Payload(marker)}))
    return ["convert", str(root), str(tmp / "out"), "--to", "hf", "--config", str(o["hf"] / "config.json")]


def _megatron_common(o, tmp, marker, outside):
    folder = _dcp_of(o, tmp)
    (folder / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    (folder / "common.pt").write_bytes(_torch_bytes({"args": Payload(marker), "iteration": 2}))
    return ["convert", str(folder), str(tmp / "out"), "--to", "hf"]


PICKLES = [
    ("index-json-pickle-protocol-0", _index_pickled(0), "index.json cannot be read"),
    ("index-json-pickle-binary", _index_pickled(5), "index.json cannot be read"),
    ("rank-json-pickle", _rank_json_pickled, "rank_00000.json cannot be read as the JSON file of a rank"),
    ("latest-pickle", _latest_pickled, "latest cannot be read as a checkpoint name"),
    ("safetensors-is-a-torch-pickle", _safetensors_pickled,
     "rank_00000.safetensors is not a valid safetensors file"),
    ("deepspeed-pt-payload", _deepspeed_torch_file, "mp_rank_00_model_states.pt cannot be read safely"),
    ("deepspeed-pt-raw-pickle", _deepspeed_raw_pickle, "mp_rank_00_model_states.pt cannot be read safely"),
    ("hf-pytorch-model-bin", _hf_bin, "holds pickled *.bin weights: parallel3d reads only safetensors"),
    ("hf-bin-finetune", _hf_bin_finetune, "holds pickled *.bin weights"),
    ("hf-auto-map-remote-code", _hf_remote_code, "parallel3d never runs code from a model folder"),
    ("hf-safetensors-is-a-pickle", _hf_safetensors_pickled, "model.safetensors is not a valid safetensors file"),
    ("dcp-metadata-pickle", _dcp_metadata_pickled, ".metadata cannot be read safely: refusing to load the global"),
    ("dcp-chunk-payload", _dcp_chunk_payload, "__0_0.distcp cannot be read safely: refusing to load the global"),
    ("deepspeed-zero3-model-states", _zero3_model_states,
     "zero_pp_rank_0_mp_rank_00_model_states.pt cannot be read safely"),
    ("megatron-legacy-payload", _megatron_legacy, "model_optim_rng.pt cannot be read safely"),
    ("megatron-common-payload", _megatron_common, "common.pt cannot be read safely"),
]


@pytest.mark.parametrize("name,build,needle", PICKLES, ids=[r[0] for r in PICKLES])
def test_pickle_payload_is_refused_without_running(name, build, needle, originals, tmp_path, capsys):
    _check_refused(name, build, needle, originals, tmp_path, capsys)


def test_controls_the_payloads_do_run_when_loaded_unsafely(originals, tmp_path):
    marker = tmp_path / "MARKER"
    pickle.loads(pickle.dumps(Payload(marker)))
    assert marker.exists()
    marker.unlink()
    path = tmp_path / "payload.pt"
    path.write_bytes(_torch_bytes({"module": {}, "extra": Payload(marker)}))
    torch.load(path, weights_only=False)  # what a loader without weights_only would do
    assert marker.exists()
    marker.unlink()
    argv = _hf_remote_code(originals, tmp_path, marker, None)
    spec = importlib.util.spec_from_file_location("modeling_evil", Path(argv[1]) / "modeling_evil.py")
    spec.loader.exec_module(importlib.util.module_from_spec(spec))  # trust_remote_code's import
    assert marker.exists()


def test_the_package_has_no_unsafe_loader():
    """A guard for new code: no pickle loads, no torch.load without weights_only=True, no
    trust_remote_code anywhere in parallel3d/ or models/."""
    import re

    root = Path(__file__).resolve().parents[1]
    offenders = []
    for path in [*(root / "parallel3d").rglob("*.py"), *(root / "models").rglob("*.py")]:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if re.search(r"\bpickle\.loads?\(|\bmarshal\.loads?\(|trust_remote_code\s*=\s*True", code) or \
                    ("torch.load(" in code and "weights_only=True" not in code):
                offenders.append(f"{path.relative_to(root)}:{n}: {line.strip()}")
    assert not offenders, offenders
