"""Megatron-Core GPT/Llama checkpoints as a source: ``torch_dist`` and legacy ``mp_rank_XX``.

Where they are (Megatron-LM's training loop)::

    ROOT/latest_checkpointed_iteration.txt     "1000"
    ROOT/iter_0001000/metadata.json            torch_dist: {"sharded_backend": "torch_dist", ...}
    ROOT/iter_0001000/common.pt                  torch.save of the non-sharded state (args, iteration)
    ROOT/iter_0001000/.metadata, __*_*.distcp    a torch DCP checkpoint of the sharded tensors
    ROOT/iter_0001000/mp_rank_TT[_PPP]/model_optim_rng.pt   legacy: one torch.save per (tp, pp)
                                                 rank: {"args", "iteration", "model": state_dict}

The model (``GPTModel`` with SwiGLU, RMSNorm, rotary embeddings, no linear biases: a Llama)
names its weights ``embedding.word_embeddings.weight``, ``decoder.layers.<i>.*``,
``decoder.final_layernorm.weight``, ``output_layer.weight``, with two fusions:

- ``self_attention.linear_qkv.weight`` (and ``.bias``): rows grouped by kv-head; group g
  holds its ``n_heads / n_kv_heads`` query heads, then its key head, then its value head;
- ``mlp.linear_fc1.weight``: the gate projection's rows, then the up projection's.

``torch_dist`` stores every tensor globally (tensor-parallel shards already in place) and
the layers *stacked*: ``decoder.layers.<name>`` of shape ``(n_layers, ...)``; the fc1 of a
tp>1 run is stored gate-then-up globally. A legacy file holds one rank's shards under
per-stage layer numbers: column-parallel tensors (qkv, fc1, embedding, output) split by
rows, each rank's fc1 its own ``[gate_r; up_r]``, row-parallel ones (``linear_proj``,
``linear_fc2``) by columns, norms replicated. Layer norms are ``input_layernorm`` /
``pre_mlp_layernorm`` (local spec) or fused into the next linear as ``layer_norm_weight``
(Transformer Engine spec); both are read.

The model config comes from the ``args`` Megatron-LM saves (``common.pt`` or a legacy
file: layers, sizes, heads, query groups, rotary base, norm epsilon, tied embeddings),
or from a Hugging Face ``config.json`` given with ``--config`` (which also gives the
true vocabulary size: Megatron pads it). What this reader cannot undo is refused in one
line: a non-SwiGLU MLP, LayerNorm, linear biases, interleaved rotary, learned positions,
kv-heads split across more tensor-parallel ranks than there are, missing rank files.
"""

from __future__ import annotations

import re
from pathlib import Path

from parallel3d.models.llama import LlamaConfig
from parallel3d.models.llama.hf import config_to_hf

from ..errors import CheckpointError, read_json_object
from ..mapped import Block, Mapping, MappedSource, rows
from ..source import find_config, model_config_of
from ..state import logical_shapes
from .torchfile import TorchFile, record_class

_ITER = re.compile(r"^iter_(\d{7,})$")
_RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?$")
OPAQUE = ("megatron", "numpy", "_io", "transformer_engine", "enum")
ALLOWED = {("argparse", "Namespace"): record_class("argparse.Namespace")}


def _iteration_folder(path: Path) -> Path | None:
    tracker = path / "latest_checkpointed_iteration.txt"
    if tracker.is_file():
        text = tracker.read_text(encoding="utf-8", errors="replace").strip()
        name = "release" if text == "release" else f"iter_{int(text):07d}" if text.isdigit() else None
        if name and (path / name).is_dir():
            return path / name
    return None


def find_megatron(path: Path) -> tuple[str, Path] | None:
    """``("torch_dist" | "legacy", iteration folder)`` of a Megatron checkpoint at ``path``."""
    folder = _iteration_folder(path) or path
    meta = folder / "metadata.json"
    if meta.is_file():
        backend = read_json_object(meta, "Megatron's metadata.json").get("sharded_backend")
        if backend != "torch_dist":
            raise CheckpointError(f"{meta}: sharded_backend {backend!r}: parallel3d reads Megatron's "
                                  "torch_dist checkpoints (and legacy mp_rank_XX ones)")
        return "torch_dist", folder
    if any(_RANK_DIR.match(p.name) for p in folder.iterdir() if p.is_dir()):
        return "legacy", folder
    return None


def load_common(path: Path) -> TorchFile:
    """A Megatron ``.pt`` (common.pt, model_optim_rng.pt), nothing executed: ``argparse``'s
    Namespace and Megatron's / NumPy's / Transformer Engine's own classes become inert
    records (the RNG states and extra states they hold are never used)."""
    return TorchFile(path, extra=ALLOWED, opaque_prefixes=OPAQUE)


def config_from_args(args, where: Path) -> LlamaConfig:
    """A Llama config from Megatron-LM's ``args``; one line naming what is not a Llama."""
    def get(name, default=None):
        return getattr(args, name, default)

    checks = [(get("swiglu") is True, "a non-SwiGLU MLP (swiglu is off)"),
              (get("normalization", "LayerNorm") == "RMSNorm", f"normalization {get('normalization')!r} (RMSNorm needed)"),
              (get("position_embedding_type", "learned_absolute") == "rope",
               f"position_embedding_type {get('position_embedding_type')!r} (rope needed)"),
              (not get("add_bias_linear", True), "linear biases (add_bias_linear)"),
              (not get("rotary_interleaved", False), "interleaved rotary embeddings"),
              (float(get("rotary_percent", 1.0)) == 1.0, f"rotary_percent {get('rotary_percent')}"),
              (not get("use_rope_scaling", False), "rope scaling (give --config with its rope_scaling)")]
    refused = [why for ok, why in checks if not ok]
    if refused:
        raise CheckpointError(f"{where} is a Megatron model parallel3d cannot read: {refused[0]} "
                              "(parallel3d reads Llama-style GPT models)")
    heads = int(get("num_attention_heads"))
    kv = int(get("num_query_groups") or heads) if get("group_query_attention") else heads
    vocab = get("vocab_size") or get("padded_vocab_size")
    return LlamaConfig(vocab_size=int(vocab), dim=int(get("hidden_size")), n_layers=int(get("num_layers")),
                       n_heads=heads, n_kv_heads=kv, ffn_dim=int(get("ffn_hidden_size")),
                       rope_theta=float(get("rotary_base", 10000)), norm_eps=float(get("norm_epsilon", 1e-5)),
                       tie_embeddings=not get("untie_embeddings_and_output_weights", False),
                       max_seq_len=int(get("max_position_embeddings") or get("seq_length") or 4096),
                       qkv_bias=bool(get("add_qkv_bias", False)))


class MegatronCheckpoint(MappedSource):
    """``model/<name>`` of a Megatron GPT checkpoint (see the module docstring).
    ``naming`` maps a tensor role to how the raw store names it (see ``megatron_legacy``)."""

    def __init__(self, folder: Path, config, store, args, iteration: int, naming):
        super().__init__(Path(folder), store, {})
        try:
            if config is not None or args is None:
                self.hf_config = find_config(self.folder, config, "Megatron")
                self.model_config = model_config_of(self.hf_config, self.folder)
            else:
                self.model_config = config_from_args(args, self.folder)
                self.hf_config = config_to_hf(self.model_config)
            self.step, self.trainer = int(iteration or 0), None
            for name, shape in logical_shapes(self.model_config).items():
                self.mappings["model/" + name] = Mapping(tuple(shape), naming.dtype,
                                                         self._parts(naming, name, tuple(shape)))
        except BaseException:
            store.close()
            raise

    def _parts(self, naming, name: str, shape) -> list:
        cfg = self.model_config
        if name == "embed_tokens.weight":
            return naming.vocab("embedding.word_embeddings.weight", shape)
        if name == "lm_head.weight":
            return naming.vocab("output_layer.weight", shape)
        if name == "norm.weight":
            return naming.replicated("decoder.final_layernorm.weight", shape, None)
        _, layer, *rest = name.split(".")
        layer, leaf = int(layer), ".".join(rest)
        hd, qpg = cfg.head_dim, cfg.n_heads // cfg.n_kv_heads
        if leaf in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            return naming.norm(leaf, layer, shape)
        if leaf.startswith("self_attn.o_proj"):
            return naming.row_parallel("self_attention.linear_proj.weight", layer, shape)
        if leaf.startswith("mlp.down_proj"):
            return naming.row_parallel("mlp.linear_fc2.weight", layer, shape)
        if leaf.startswith(("mlp.gate_proj", "mlp.up_proj")):
            return naming.gate_up("mlp.linear_fc1.weight", layer, shape, up=leaf.startswith("mlp.up"))
        which = leaf.split(".")[1][0]  # q / k / v
        suffix = leaf.rsplit(".", 1)[-1]
        per_group = {"q": qpg * hd, "k": hd, "v": hd}[which]
        start = {"q": 0, "k": qpg * hd, "v": (qpg + 1) * hd}[which]
        return naming.qkv(f"self_attention.linear_qkv.{suffix}", layer, shape, per_group, start,
                          (qpg + 2) * hd, cfg.n_kv_heads)


def group_rows(key: str, lead: tuple, shape, per_group: int, start: int, stride: int,
               n_groups: int, out_group0: int = 0) -> list[Block]:
    """The rows of one role (q, k or v) in a kv-grouped fused tensor holding ``n_groups``
    groups of ``stride`` rows: local group j's rows ``[j*stride + start, + per_group)`` are
    logical rows ``[(out_group0 + j) * per_group, ...)``."""
    rest = tuple(shape[1:])
    return [rows(key, (per_group,) + rest, j * stride + start, lead, (out_group0 + j) * per_group)
            for j in range(n_groups)]
