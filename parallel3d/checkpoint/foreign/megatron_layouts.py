"""Where each Megatron tensor role lives in a ``torch_dist`` folder and in legacy rank files
(see :mod:`.megatron` for both layouts). A *naming* answers, for one parallel3d tensor,
which blocks of which raw tensors tile it; :class:`~parallel3d.checkpoint.foreign.megatron.MegatronCheckpoint`
asks it per role."""

from __future__ import annotations

import re
from pathlib import Path

from .dcp_read import DCPStore
from ..errors import CheckpointError
from ..mapped import Block, LazyStore, rows, whole
from .megatron import OPAQUE, _RANK_DIR, MegatronCheckpoint, group_rows, load_common
from .torchfile import LazyTensor

_NORMS = {"input_layernorm.weight": ("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight"),
          "post_attention_layernorm.weight": ("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight")}


def _args_of(obj) -> tuple:
    if not isinstance(obj, dict):
        return None, 0
    return obj.get("args"), int(obj.get("iteration") or 0)


class TorchDistNaming:
    """Global tensors; layers stacked (``decoder.layers.<name>``, leading layer axis) or,
    from other writers, one key per layer (``decoder.layers.<i>.<name>``)."""

    def __init__(self, store: DCPStore):
        self.store, self.shapes = store, {k: e.shape for k, e in store.tensors().items()}
        emb = store.entries.get("embedding.word_embeddings.weight")
        if emb is None:
            raise CheckpointError(f"{store.folder} has no embedding.word_embeddings.weight: not a "
                                  f"Megatron GPT model (keys {sorted(self.shapes)[:4]})")
        self.dtype = emb.dtype

    def _key(self, name: str, layer: int | None, shape) -> tuple[str, tuple]:
        if layer is None:
            key, lead = name, ()
        elif f"decoder.layers.{name}" in self.shapes:
            key, lead = f"decoder.layers.{name}", (layer,)
        else:
            key, lead = f"decoder.layers.{layer}.{name}", ()
        if key not in self.shapes:
            raise CheckpointError(f"{self.store.folder} has no tensor {key} (missing shards, or "
                                  "not a GPT/Llama model?)")
        return key, lead

    def vocab(self, key: str, shape) -> list[Block]:
        key, _ = self._key(key, None, shape)
        if self.shapes[key][0] < shape[0]:
            raise CheckpointError(f"{self.store.folder}: {key} has {self.shapes[key][0]} rows, the "
                                  f"vocabulary {shape[0]}")
        return [rows(key, shape, 0)]

    def replicated(self, name: str, shape, layer) -> list[Block]:
        key, lead = self._key(name, layer, shape)
        return whole(key, shape, lead)

    def norm(self, leaf: str, layer: int, shape) -> list[Block]:
        for name in _NORMS[leaf]:
            if f"decoder.layers.{name}" in self.shapes or f"decoder.layers.{layer}.{name}" in self.shapes:
                return self.replicated(name, shape, layer)
        raise CheckpointError(f"{self.store.folder} has no {' or '.join(_NORMS[leaf])} for layer {layer}")

    def row_parallel(self, name: str, layer: int, shape) -> list[Block]:
        return self.replicated(name, shape, layer)

    def gate_up(self, name: str, layer: int, shape, up: bool) -> list[Block]:
        key, lead = self._key(name, layer, shape)
        return [rows(key, shape, shape[0] if up else 0, lead)]

    def qkv(self, name: str, layer: int, shape, per_group, start, stride, n_kv) -> list[Block]:
        key, lead = self._key(name, layer, shape)
        return group_rows(key, lead, shape, per_group, start, stride, n_kv)


def torch_dist_parts(folder: Path):
    store = DCPStore(folder, opaque_prefixes=OPAQUE)
    try:
        args, iteration = None, 0
        if (folder / "common.pt").is_file():
            with load_common(folder / "common.pt") as common:
                args, iteration = _args_of(common.obj)
        return store, args, iteration, TorchDistNaming(store)
    except BaseException:
        store.close()
        raise


class LegacyNaming:
    """One ``model_optim_rng.pt`` per (tp, pp) rank; keys ``"<tp>/<pp>:<name>"`` in the store."""

    def __init__(self, folder: Path, store: LazyStore, tp: int, pp: int, layers: list[list[int]]):
        self.folder, self.store, self.tp, self.pp = folder, store, tp, pp
        self.first = [0]  # first global layer of each stage
        for stage in layers[:-1]:
            self.first.append(self.first[-1] + len(stage))
        self.dtype = store.tensors["0/0:embedding.word_embeddings.weight"].dtype

    def _raw(self, t: int, p: int, name: str) -> str:
        key = f"{t}/{p}:{name}"
        if key not in self.store.tensors:
            raise CheckpointError(f"{self.folder}: rank (tp {t}, pp {p}) has no {name} (missing "
                                  "shards, or not a GPT/Llama model?)")
        return key

    def _stage(self, layer: int) -> tuple[int, str]:
        p = max(i for i, f in enumerate(self.first) if f <= layer)
        return p, f"decoder.layers.{layer - self.first[p]}."

    def vocab(self, name: str, shape) -> list[Block]:
        p = 0 if name.startswith("embedding") else self.pp - 1
        out, at = [], 0
        for t in range(self.tp):
            key = self._raw(t, p, name)
            n = min(self.store.tensors[key].shape[0], shape[0] - at)
            if n > 0:
                out.append(rows(key, (n,) + tuple(shape[1:]), 0, (), at))
            at += self.store.tensors[key].shape[0]
        if at < shape[0]:
            raise CheckpointError(f"{self.folder}: {name} has {at} rows over the tp ranks, the vocabulary {shape[0]}")
        return out

    def replicated(self, name: str, shape, layer) -> list[Block]:
        if layer is None:
            return whole(self._raw(0, self.pp - 1, name), shape)
        p, prefix = self._stage(layer)
        return whole(self._raw(0, p, prefix + name), shape)

    def norm(self, leaf: str, layer: int, shape) -> list[Block]:
        p, prefix = self._stage(layer)
        for name in _NORMS[leaf]:
            if f"0/{p}:{prefix}{name}" in self.store.tensors:
                return self.replicated(name, shape, layer)
        raise CheckpointError(f"{self.folder} has no {' or '.join(_NORMS[leaf])} for layer {layer}")

    def row_parallel(self, name: str, layer: int, shape) -> list[Block]:
        p, prefix = self._stage(layer)
        cols = shape[1] // self.tp
        return [Block(self._raw(t, p, prefix + name), (0, 0), (0, t * cols), (shape[0], cols))
                for t in range(self.tp)]

    def gate_up(self, name: str, layer: int, shape, up: bool) -> list[Block]:
        p, prefix = self._stage(layer)
        n = shape[0] // self.tp  # rank t holds [gate_t; up_t], n rows each
        return [rows(self._raw(t, p, prefix + name), (n,) + tuple(shape[1:]), n if up else 0, (), t * n)
                for t in range(self.tp)]

    def qkv(self, name: str, layer: int, shape, per_group, start, stride, n_kv) -> list[Block]:
        if n_kv % self.tp:
            raise CheckpointError(f"{self.folder}: {n_kv} kv-heads split over tp {self.tp} ranks: "
                                  "each rank's fused qkv holds replicated kv-heads, which this reader "
                                  "cannot undo")
        p, prefix = self._stage(layer)
        local = n_kv // self.tp
        out = []
        for t in range(self.tp):
            out += group_rows(self._raw(t, p, prefix + name), (), shape, per_group, start, stride,
                              local, t * local)
        return out


_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


def legacy_parts(folder: Path):
    ranks = {}
    for d in folder.iterdir():
        m = _RANK_DIR.match(d.name)
        if m and d.is_dir():
            ranks[(int(m.group(1)), int(m.group(2) or 0))] = d / "model_optim_rng.pt"
    tp = max(t for t, _ in ranks) + 1
    pp = max(p for _, p in ranks) + 1
    missing = [f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else "")
               for t in range(tp) for p in range(pp) if not ranks.get((t, p), Path("/nonexistent")).is_file()]
    if missing:
        raise CheckpointError(f"{folder}: rank files of {missing[:3]} are missing (tp {tp} x pp {pp}): "
                              "the checkpoint is incomplete")
    files, tensors, args, iteration = [], {}, None, 0
    layers: list[set] = [set() for _ in range(pp)]
    try:
        for (t, p), path in sorted(ranks.items()):
            f = load_common(path)
            files.append(f)
            obj = f.obj if isinstance(f.obj, dict) else {}
            model = obj.get("model") if isinstance(obj.get("model"), dict) else obj.get("model0")
            if not isinstance(model, dict):
                raise CheckpointError(f"{path} holds no 'model' state dict: not a Megatron checkpoint")
            if (t, p) == (0, 0):
                args, iteration = _args_of(obj)
            for k, v in model.items():
                if isinstance(v, LazyTensor):
                    tensors[f"{t}/{p}:{k}"] = v
                    if m := _LAYER.match(k):
                        layers[p].add(int(m.group(1)))
    except BaseException:
        for f in files:
            f.close()
        raise
    store = LazyStore(tensors, files)
    return store, args, iteration, LegacyNaming(folder, store, tp, pp, [sorted(s) for s in layers])


def open_megatron(found: tuple[str, Path], config=None) -> MegatronCheckpoint:
    """The checkpoint :func:`~parallel3d.checkpoint.foreign.megatron.find_megatron` found, as a
    source: its tensors laid out by the layout of its kind (here, so that the layouts
    import the checkpoint class and not the other way round)."""
    kind, folder = found
    parts = torch_dist_parts(folder) if kind == "torch_dist" else legacy_parts(folder)
    return MegatronCheckpoint(folder, config, *parts)
