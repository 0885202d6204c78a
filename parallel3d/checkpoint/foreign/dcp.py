"""A torch DCP checkpoint as a source: Hugging Face naming (``model.state_dict()`` of a
``LlamaForCausalLM``, plain or wrapped by FSDP2) or torchtitan's Llama naming, with the
Adam moments, step and learning rate when the checkpoint holds an optimizer. An MoE
model's experts are read per expert (the on-disk Hugging Face names) or out of
transformers 5's stacked ``experts.gate_up_proj`` / ``experts.down_proj``.

Naming is recognised by the embedding's key: ``<P>model.embed_tokens.weight`` (Hugging
Face) or ``<P>tok_embeddings.weight`` (torchtitan), where ``<P>`` is whatever the saving
code nested the model under (``""``, ``"model."``, ``"app.model."``). torchtitan keeps
Meta's interleaved rotary layout, so its ``wq`` / ``wk`` rows are permuted per head into
Hugging Face's (:class:`~parallel3d.checkpoint.mapped.Permuted`); its ``freqs_cis`` buffer
is not a weight and is skipped.

Optimizer state is found by parameter name: torch's ``get_optimizer_state_dict`` (also
torchtitan's flattened form) stores ``...state.<param fqn>.exp_avg`` / ``exp_avg_sq`` /
``step``; an optimizer saved by ``optimizer.state_dict()`` (integer ids) has no names and
is not imported (the weights convert, and a resume says the optimizer starts fresh). The
model is described by a Hugging Face ``config.json`` given with ``--config`` or found
beside / above the folder.
"""

from __future__ import annotations

import re
from pathlib import Path

from parallel3d.models.llama.hf import name_to_hf

from .dcp_read import DCPStore
from ..errors import CheckpointError
from ..mapped import Mapping, MappedSource, Permuted, rows, whole
from ..source import find_config, model_config_of
from ..state import logical_shapes

# torchtitan's names, newest first: 0.3 nests q/k/v under ``qkv_linear`` and calls the head
# ``lm_head``; earlier releases have ``attention.wq`` and ``output``.
_TITAN = {"embed_tokens.weight": ("tok_embeddings.weight",), "norm.weight": ("norm.weight",),
          "lm_head.weight": ("lm_head.weight", "output.weight")}
_TITAN_LAYER = {"self_attn.q_proj": ("attention.qkv_linear.wq", "attention.wq"),
                "self_attn.k_proj": ("attention.qkv_linear.wk", "attention.wk"),
                "self_attn.v_proj": ("attention.qkv_linear.wv", "attention.wv"),
                "self_attn.o_proj": ("attention.wo",), "mlp.gate_proj": ("feed_forward.w1",),
                "mlp.down_proj": ("feed_forward.w2",), "mlp.up_proj": ("feed_forward.w3",),
                "input_layernorm": ("attention_norm",), "post_attention_layernorm": ("ffn_norm",)}
MOMENTS = ("exp_avg", "exp_avg_sq")


def titan_names(name: str) -> tuple[str, ...]:
    """torchtitan's candidate names of parallel3d parameter ``name``."""
    if name in _TITAN:
        return _TITAN[name]
    parts = name.split(".")  # layers.<i>.<module>.<sub>.weight
    if parts[0] == "layers":
        module, leaf = ".".join(parts[2:-1]), parts[-1]
        if module in _TITAN_LAYER:
            return tuple(f"layers.{parts[1]}.{m}.{leaf}" for m in _TITAN_LAYER[module])
    raise CheckpointError(f"torchtitan naming has no counterpart of {name}")


def _naming(keys) -> tuple[str, str]:
    """(naming, prefix) from the embedding's key."""
    for key in keys:
        for suffix, naming in (("model.embed_tokens.weight", "hf"), ("tok_embeddings.weight", "titan")):
            if key.endswith(suffix) and (key == suffix or key[:-len(suffix)].endswith(".")):
                prefix = key[:-len(suffix)]
                if not any(s in prefix for s in ("state.", "param_groups.")):
                    return naming, prefix
    return "", ""


_EXPERT = re.compile(r"layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")


def fused_expert(name: str, cfg, tensors, prefix: str) -> list | None:
    """Expert ``e``'s weight inside the stacked tensors of transformers 5's ``state_dict()``
    (what FSDP2 or a plain ``dcp.save`` of an HF MoE model writes):
    ``model.layers.L.mlp.experts.gate_up_proj`` (E, 2f, dim), gate rows first, and
    ``...experts.down_proj`` (E, dim, f). None when ``name`` is no expert weight or the
    checkpoint has no such stack."""
    m = _EXPERT.fullmatch(name)
    if m is None or cfg.moe is None:
        return None
    layer, expert, which = int(m[1]), int(m[2]), m[3]
    stem = f"{prefix}model.layers.{layer}.mlp.experts."
    f, dim = cfg.moe.ffn_dim, cfg.dim
    if which == "down_proj":
        key, want, start = stem + "down_proj", (cfg.moe.n_experts, dim, f), 0
    else:
        key, want, start = stem + "gate_up_proj", (cfg.moe.n_experts, 2 * f, dim), 0 if which == "gate_proj" else f
    if key not in tensors:
        return None
    if tuple(tensors[key].shape) != want:
        raise CheckpointError(f"{key} has shape {list(tensors[key].shape)}, config.json implies {list(want)}")
    shape = (dim, f) if which == "down_proj" else (f, dim)
    return [rows(key, shape, start, lead=(expert,))]


class DCPCheckpoint(MappedSource):
    def __init__(self, folder: Path, config=None):
        store = DCPStore(folder)
        super().__init__(Path(folder), store, {})
        try:
            self._build(config)
        except BaseException:
            store.close()
            raise

    def _build(self, config) -> None:
        tensors = self.store.tensors()
        self.naming, prefix = _naming(tensors)
        if not self.naming:
            raise CheckpointError(f"{self.folder} is a DCP checkpoint of an unknown model: no "
                                  "'model.embed_tokens.weight' (Hugging Face naming) or "
                                  "'tok_embeddings.weight' (torchtitan naming) among its keys "
                                  f"{sorted(tensors)[:4]}")
        self.hf_config = find_config(self.folder, config, "DCP")
        self.model_config = model_config_of(self.hf_config, self.folder)
        cfg = self.model_config
        candidates = (lambda n: (name_to_hf(n),)) if self.naming == "hf" else titan_names
        self.fqns = {}
        for name, shape in logical_shapes(cfg).items():
            options = candidates(name)
            fqn = next((f for f in options if prefix + f in tensors), options[0])
            key = prefix + fqn
            fused = fused_expert(name, cfg, tensors, prefix) if key not in tensors else None
            if fused is not None:  # transformers >= 5 keeps a layer's experts stacked
                self.fqns[name] = fused[0].key[len(prefix):]
                self.mappings["model/" + name] = Mapping(tuple(shape), tensors[fused[0].key].dtype, fused)
                continue
            if key not in tensors:
                raise CheckpointError(f"{self.folder}: no tensor {key} for {name} ({self.naming} naming; "
                                      "missing shards, or config.json describes another model?)")
            if tuple(tensors[key].shape) != tuple(shape):
                raise CheckpointError(f"{self.folder}: {key} has shape {list(tensors[key].shape)}, "
                                      f"config.json implies {list(shape)}")
            self.fqns[name] = fqn
            self.mappings["model/" + name] = Mapping(tuple(shape), tensors[key].dtype,
                                                     self._parts(name, key, shape))
        self._optimizer(tensors)
        self.step = self._train_step()
        if self.trainer is not None:
            self.trainer["step"] = self.step

    def _parts(self, name: str, key: str, shape) -> list:
        cfg = self.model_config
        if self.naming == "titan" and name.endswith(("self_attn.q_proj.weight", "self_attn.k_proj.weight")):
            heads = cfg.n_heads if "q_proj" in name else cfg.n_kv_heads
            return [Permuted(key, (0, 0), tuple(shape), heads)]
        return whole(key, shape)

    def _optimizer(self, tensors) -> None:
        """``optim/<moment>/<name>`` mappings, and the step and lr, when the checkpoint has
        FQN-keyed Adam state for every parameter."""
        found: dict[tuple[str, str], str] = {}
        by_fqn = {fqn: name for name, fqn in self.fqns.items()}
        steps = []
        for key in tensors:
            leaf = key.rsplit(".", 1)[-1]
            if leaf not in MOMENTS + ("step",):
                continue
            base = key[:-len(leaf) - 1]
            at = base.find("state.")
            while at >= 0:
                fqn = base[at + len("state."):]
                if fqn in by_fqn:
                    if leaf == "step":
                        steps.append(key)
                    else:
                        found[(leaf, by_fqn[fqn])] = key
                    break
                at = base.find("state.", at + 1)
        if not found:
            self.trainer = None
            return
        missing = [f"{m}/{n}" for n in self.fqns for m in MOMENTS if (m, n) not in found]
        if missing:
            raise CheckpointError(f"{self.folder} holds Adam state for some parameters but not "
                                  f"{missing[:3]}: the optimizer checkpoint is incomplete")
        for (moment, name), key in found.items():
            base = self.mappings["model/" + name]
            parts = [type(p)(key, *[getattr(p, f) for f in p.__dataclass_fields__ if f != "key"])
                     for p in base.parts]
            self.mappings[f"optim/{moment}/{name}"] = Mapping(base.shape, tensors[key].dtype, parts)
        step = int(self.store.value(steps[0])) if steps else 0
        self.trainer = {"step": step, "optimizer": {"kind": "adamw", "step": step, **self._hyper()}}

    def _hyper(self) -> dict:
        """lr, betas, eps, weight_decay of the first param group, if stored by name."""
        for key, e in self.store.entries.items():
            if key.rsplit(".", 1)[-1] == "param_groups" and e.dtype is None:
                groups = self.store.value(key)
                if isinstance(groups, list) and groups and isinstance(groups[0], dict):
                    g = groups[0]
                    return {k: (list(g[k]) if k == "betas" else g[k])
                            for k in ("lr", "betas", "eps", "weight_decay") if k in g}
        out = {}
        for key, e in self.store.entries.items():
            if ".param_groups." in f".{key}" and key.rsplit(".", 1)[-1] in ("lr", "eps", "weight_decay"):
                out.setdefault(key.rsplit(".", 1)[-1], self.store.value(key))
        return out

    def _train_step(self) -> int:
        """A training step stored beside the model (``step``, ``train_state.step``), else
        the optimizer's."""
        for key in self.store.entries:
            if (key == "step" or key.endswith("train_state.step")) and "state." not in key.replace("train_state.", ""):
                value = self.store.value(key)
                if isinstance(value, (int, float)):
                    return int(value)
        return int(self.trainer["optimizer"]["step"]) if self.trainer else 0
