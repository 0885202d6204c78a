"""PEFT adapter folders in: ``adapter_config.json`` + ``adapter_model.safetensors``.

PEFT names an adapter factor ``base_model.model.<HF name of the layer>.lora_A.weight``;
parallel3d's parameter names are the Hugging Face names without the ``model.`` prefix
(``layers.0.self_attn.q_proj.lora_A.weight``), so the key is ``PREFIX + name``. Each
rank reads only its slice of each factor (``safe_open(...).get_slice``): the rows of a
column-parallel ``B``, the columns of a row-parallel ``A``, whole otherwise.

A Mixture-of-Experts model's routed experts, which transformers 5 fuses and peft adapts
through ``target_parameters`` (``checkpoint/foreign/peft_experts.py``: the layout), are
read onto our per-expert adapters of rank r. Of a fused parameter at rank R (E experts,
``A_e`` rows [e R, (e + 1) R) of A, ``B_e`` = B viewed (out, R, E) at expert e), the
projection j of its output rows (gate_up_proj: gate's ``[0, f)``, up's ``[f, 2f)``) takes

    R = r     A_j = A_e,                  B_j = B_e[rows j]             (one adapter, shared A)
    R = 2r    A_j = A_e[j r:(j + 1) r],   B_j = B_e[rows j, j r:(j + 1) r]   (block-diagonal B)

exactly (the fused delta's rows are each projection's), when alpha_R / R = alpha / r; the
other blocks of B (another projection's columns at 2r, a projection lora.targets lacks)
must be zero, else the folder is refused. A rank reads its own experts' rows of A and
columns of B (R slices of B, whose expert axis is the fast one), and checks those zeros. R = r is
what peft makes (one adapter on the fused rows), R = 2r what ``checkpoint.export_peft``
writes (``rank_pattern``). lora.targets must name what the folder adapts: its
target_modules, down_proj for ``experts.down_proj``, gate_proj for ``gate_proj.weight``
(a dense layer's, the shared expert's), and for ``experts.gate_up_proj`` gate_proj or
up_proj or both.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from parallel3d.errors import UserError

from .adapters import adapter_parameters, model_config, trained_whole

PREFIX = "base_model.model.model."
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
VOCAB_ROWS = ("embed_tokens.weight", "lm_head.weight")  # rows: our vocabulary padded to a multiple of tp
# transformers' fused expert parameter -> our projections on it, in the order of its output rows
FUSED = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
MLP = ("gate_proj", "up_proj", "down_proj")
EXPERT_FACTOR = re.compile(r"(layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.lora_([AB])\.weight")


def modules_to_save(trainable) -> list[str] | None:
    """``lora.trainable`` as PEFT's ``modules_to_save``, which wraps every module whose name
    ends with a key: the final norm as ``model.norm`` (``norm`` would take every layer's
    norms too); the others' names end no other module's."""
    return sorted("model.norm" if t == "norm" else t for t in trainable) or None


def peft_key(name: str) -> str:
    """The adapter file's key of our parameter ``name``: PEFT's prefix on its Hugging Face
    name (the head is no part of the HF ``model.``)."""
    return "base_model.model." + name if name.startswith("lm_head.") else PREFIX + name


def read_adapter_config(folder: str | Path) -> dict:
    path = Path(folder) / CONFIG_FILE
    if not path.is_file():
        raise UserError(f"lora.adapter {folder}: no {CONFIG_FILE} there; point lora.adapter at a PEFT adapter folder")
    return json.loads(path.read_text())


def wrapper_name(stem: str, param: str, adapted: list[str]) -> str:
    """Our name (``peft_key``'s input) of the peft wrapper holding fused ``param``'s factors
    in ``stem`` (``layers.N.mlp.experts``), given every fused parameter ``adapted`` there in
    registration order: each wrapper wraps the previous one, so the first is the deepest."""
    return stem + ".base_layer" * (len(adapted) - 1 - adapted.index(param))


def fused_parameters(hf: dict) -> list[str]:
    """The fused expert parameters (``FUSED``'s keys) the folder's ``target_parameters``
    adapt, in the order peft nests their wrappers (the experts module's registration order)."""
    named = [t.rpartition(".")[2] for t in hf.get("target_parameters") or []]
    return [p for p in FUSED if p in named]


def _adapted(hf: dict) -> tuple[set, set, list[str]]:
    """(the projections lora.targets must name, those it may name, the folder's
    target_parameters that name none) of the folder's target_modules and target_parameters:
    ``experts.gate_up_proj`` gate_proj or up_proj or both, ``experts.down_proj`` and
    ``gate_proj.weight`` (2-d: a dense layer's, the shared expert's) their own."""
    must, unread = set(hf.get("target_modules") or []), []
    for t in hf.get("target_parameters") or []:
        module, _, leaf = t.rpartition(".")
        if leaf == "down_proj" or (leaf == "weight" and module.rpartition(".")[2] in MLP):
            must.add(leaf if leaf == "down_proj" else module.rpartition(".")[2])
        elif leaf != "gate_up_proj":
            unread.append(t)
    may = must | (set(FUSED["gate_up_proj"]) if "gate_up_proj" in fused_parameters(hf) else set())
    return must, may, unread


def _target_problems(hf: dict, lora) -> list[str]:
    modules = hf.get("target_modules") or []
    if isinstance(modules, str):
        return [f"its target_modules are the pattern {modules!r}: set lora.targets to the projections it matches"]
    must, may, unread = _adapted(hf)
    out = [f"its target_parameters {unread} are not read (the experts' gate_up_proj and down_proj, the MLP "
           "projections' weight are)"] if unread else []
    targets = set(lora.targets)
    neither = "gate_up_proj" in fused_parameters(hf) and not targets & set(FUSED["gate_up_proj"])
    if not hf.get("target_parameters") and targets != must:
        out.append(f"its target_modules are {modules}: set lora.targets to that list")
    elif not (must <= targets <= may) or neither:
        split = sorted(may - must)  # gate_up_proj's that no 2-d parameter makes a must
        hint = f" (or without one of {split} whose rows of gate_up_proj are zero)" if split else ""
        out.append(f"its target_modules and target_parameters adapt {sorted(may)}: set lora.targets to that list{hint}")
    return out


def _pattern_problems(hf: dict, lora) -> list[str]:
    """rank_pattern / alpha_pattern: only gate_up_proj's may differ (checked per layer)."""
    out = []
    for field, want, change in (("rank_pattern", lora.rank, "rank"), ("alpha_pattern", lora.alpha, "alpha")):
        for key, value in (hf.get(field) or {}).items():
            if not key.endswith("gate_up_proj") and float(value) != float(want):
                out.append(f"its {field} gives {key} {value}, not lora.{change} {want}: lora.adapter reads "
                           f"adapters of one {change} (gate_up_proj's aside); drop {key} from {field}")
    return out


def check_adapter_config(hf: dict, lora, folder) -> None:
    """Raise :class:`UserError` when the folder's adapter is not the ``[lora]`` section's."""
    problems = []
    if hf.get("peft_type", "LORA") != "LORA":
        problems.append(f"peft_type {hf.get('peft_type')} is not LORA")
    if hf.get("r") != lora.rank:
        problems.append(f"its r is {hf.get('r')}: set lora.rank={hf.get('r')}")
    if float(hf.get("lora_alpha", 8)) != float(lora.alpha):
        problems.append(f"its lora_alpha is {hf.get('lora_alpha')}: set lora.alpha={hf.get('lora_alpha')}")
    problems += _target_problems(hf, lora) + _pattern_problems(hf, lora)
    for key, off in (("use_rslora", False), ("use_dora", False), ("fan_in_fan_out", False), ("bias", "none")):
        if hf.get(key, off) != off:
            problems.append(f"{key}={hf.get(key)} is not supported")
    saved = hf.get("modules_to_save") or None
    if (sorted(saved) if isinstance(saved, list) else saved) != modules_to_save(lora.trainable):
        names = ["norm" if m == "model.norm" else m for m in saved or []]
        problems.append(f"its modules_to_save are {saved}: set lora.trainable={names}")
    if problems:
        raise UserError(f"lora.adapter {folder}: " + "; ".join(problems))


def _pattern(patterns: dict, key: str, default):
    """peft's ``get_pattern_key``: the first pattern matching the end of ``key``."""
    for pattern, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", key):
            return value
    return default


def _column_blocks(hf: dict, lora, stem: str, param: str, folder) -> tuple[int, dict[str, int]]:
    """(R, projection -> its block of r columns in B_e) of ``stem``'s fused ``param``:
    block 0 for every projection at R = r, block j for the j-th at R = 2r (gate_up_proj);
    refuses any other rank, or a scaling alpha_R / R that is not alpha / r."""
    key, r = f"model.{stem}.{param}", lora.rank
    rank = int(_pattern(hf.get("rank_pattern"), key, hf.get("r")))
    alpha = float(_pattern(hf.get("alpha_pattern"), key, hf.get("lora_alpha", 8)))
    parts = FUSED[param]
    if rank not in {r, len(parts) * r} or alpha * r != float(lora.alpha) * rank:
        joined = f" or {2 * r} ({2 * lora.alpha}), B block-diagonal" if len(parts) > 1 else ""
        raise UserError(f"lora.adapter {folder}: {key} is adapted at rank {rank}, alpha {alpha}, which rank-{r} "
                        f"adapters per projection do not hold: give it rank_pattern {r} (alpha_pattern "
                        f"{lora.alpha}){joined}")
    return rank, {p: (j if rank > r else 0) for j, p in enumerate(parts)}


def _check_zeros(b: torch.Tensor, blocks: dict[str, int], r: int, lora, key: str, folder) -> None:
    """The blocks of ``b`` (parts, rows, R, this rank's experts) that no projection of ours
    reads are zero."""
    for j, proj in enumerate(blocks):
        if proj not in lora.targets and b[j].any():
            raise UserError(f"lora.adapter {folder}: {key} adapts {proj} (its rows are not zero), which "
                            f"lora.targets lacks: add {proj} to lora.targets")
        others = torch.ones(b.shape[2], dtype=torch.bool)
        others[blocks[proj] * r:(blocks[proj] + 1) * r] = False
        if b[j][:, others].any():
            raise UserError(f"lora.adapter {folder}: {key} at rank {b.shape[2]} is not block-diagonal ({proj}'s rows "
                            f"read the other projection's factors), which is no pair of rank-{r} adapters: merge "
                            "it into the base (peft's merge_and_unload) and train on that")


def _load_fused(f, keys: set, hf: dict, lora, stem: str, param: str, held: list, n_experts: int, folder) -> None:
    """Fill ``held`` ((expert, projection, "A" or "B", parameter) of ``stem``'s experts)
    from the fused ``param``'s factors (the module docstring's mapping), reading this
    rank's experts' rows of A and columns of B only."""
    key = PREFIX + wrapper_name(stem, param, fused_parameters(hf))
    for k in (key + ".lora_A.weight", key + ".lora_B.weight"):
        if k not in keys:
            raise UserError(f"lora.adapter {folder}: {k} is missing; the adapter was made for other layers")
    rank, blocks = _column_blocks(hf, lora, stem, param, folder)
    r, parts, b = lora.rank, list(blocks), None
    lo, hi = min(e for e, *_ in held), max(e for e, *_ in held) + 1  # this rank's experts
    for e, proj, which, p in held:
        factor = f.get_slice(f"{key}.lora_{which}.weight")
        want = [rank * n_experts, p.shape[1]] if which == "A" else [len(parts) * p.shape[0], rank * n_experts]
        if list(factor.get_shape()) != want:
            raise UserError(f"lora.adapter {folder}: {key}.lora_{which}.weight has shape {factor.get_shape()}, "
                            f"this model's {n_experts} experts' {proj} at rank {rank} need {want}")
        start = blocks[proj] * r
        if which == "A":
            piece = factor[e * rank + start:e * rank + start + r]  # (r, in): this expert's rows only
        else:
            if b is None:  # (parts, rows, R, hi - lo): the expert is the fast axis of B's columns
                cols = [factor[:, k * n_experts + lo:k * n_experts + hi] for k in range(rank)]
                b = torch.stack(cols, dim=1).view(len(parts), p.shape[0], rank, hi - lo)
                _check_zeros(b, blocks, r, lora, key + ".lora_B.weight", folder)
            piece = b[parts.index(proj), :, start:start + r, e - lo]  # (rows, r)
        p.copy_(piece.to(p.dtype))


def _load_one(f, keys: set, name: str, p: torch.Tensor, vocab: int, folder) -> None:
    """Fill ``p`` (our ``name``) with this rank's slice of its own key's tensor."""
    key = peft_key(name)
    if key not in keys:
        raise UserError(f"lora.adapter {folder}: {key} is missing; the adapter was made for other layers")
    block = f.get_slice(key)
    dim = getattr(p, "p3d_tp_dim", None)
    want = list(p.shape)
    if dim is not None:
        want[dim] = p.p3d_tp_full
    if name in VOCAB_ROWS:
        want[0] = vocab  # the file's rows: the vocabulary without our padding
    if list(block.get_shape()) != want:
        raise UserError(f"lora.adapter {folder}: {key} has shape {block.get_shape()}, this model's needs {want}")
    if dim is None:
        piece = block[:]
        p.narrow(0, 0, piece.shape[0]).copy_(piece.to(p.dtype))  # (rows past the vocabulary: padding)
        return
    start, stop = p.p3d_tp_range
    stop = min(stop, want[dim])  # (a vocabulary shard's padding rows stay as they are)
    if stop > start:
        piece = block[start:stop] if dim == 0 else block[:, start:stop]
        p.narrow(dim, 0, stop - start).copy_(piece.to(p.dtype))


@torch.no_grad()
def load_adapter_(model: torch.nn.Module, lora, only=None) -> None:
    """Fill every adapter factor of ``model`` (those in ``only``, when given: ZeRO 3's
    bucket being filled) with this rank's slice of ``lora.adapter``; a routed expert's from
    the fused parameter the folder adapts, if it adapts one (the module docstring)."""
    from safetensors import safe_open

    folder = Path(lora.adapter)
    hf = read_adapter_config(folder)
    check_adapter_config(hf, lora, folder)
    path = folder / WEIGHTS_FILE
    if not path.is_file():
        raise UserError(f"lora.adapter {folder}: no {WEIGHTS_FILE} there (only safetensors adapters are read)")
    vocab, nested = model_config(model).vocab_size, fused_parameters(hf)
    fused: dict[tuple[str, str], list] = {}
    with safe_open(str(path), framework="pt") as f:
        keys = set(f.keys())
        for name, p in adapter_parameters(model, only) + trained_whole(model, only):  # + modules_to_save
            m = EXPERT_FACTOR.fullmatch(name)
            param = next((q for q in nested if m and m[3] in FUSED[q]), None)
            if param is None:
                _load_one(f, keys, name, p, vocab, folder)
            else:
                fused.setdefault((m[1], param), []).append((int(m[2]), m[3], m[4], p))
        for (stem, param), held in fused.items():
            _load_fused(f, keys, hf, lora, stem, param, held, model_config(model).moe.n_experts, folder)
