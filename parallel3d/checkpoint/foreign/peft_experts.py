"""A Mixture-of-Experts layer's expert adapters in a PEFT folder.

transformers 5 keeps a layer's routed experts fused, ``mlp.experts.gate_up_proj``
(E, 2f, dim), the gate's rows first, and ``mlp.experts.down_proj`` (E, dim, f) (Qwen2-MoE,
Qwen3-MoE, Mixtral, OLMoE alike), which peft adapts through ``target_parameters``
(``lora.ParamWrapper``). For a parameter (E, out, in) adapted at rank R:

    lora_A.weight (R E, in)     A_e = rows [e R, (e + 1) R)           expert-major
    lora_B.weight (out, R E)    B_e = columns e, E + e, 2 E + e, ..   the expert the fast axis
    W_e + (alpha_R / R) B_e A_e

parallel3d gives each expert's gate_proj, up_proj and down_proj an adapter of rank r
(``lora/experts.py``). down_proj's carry over one to one (R = r). gate_proj's and
up_proj's join on gate_up_proj: both adapted, R = 2r and

    A_e = [A_gate_e; A_up_e]                      (2r, dim)
    B_e = [[B_gate_e, 0], [0, B_up_e]]            (2f, 2r)
    B_e A_e = [B_gate_e A_gate_e; B_up_e A_up_e]  each projection's own delta

with ``rank_pattern`` 2r and ``alpha_pattern`` 2 alpha for ``experts.gate_up_proj`` (the
scaling stays alpha / r; peft 0.21 applies them to a parameter, and warns that they "did
not match any targeted module and were ignored", having checked target_modules only); one
of them adapted, R = r and the other's rows of B are zero.

peft wraps the parameters of one module in the order the module registers them
(gate_up_proj, then down_proj), each wrapper around the last: both adapted, gate_up_proj's
factors are ``...mlp.experts.base_layer.lora_A.weight`` and down_proj's
``...mlp.experts.lora_A.weight``.

The MLP projections outside the routed experts (dense layers, the shared expert) are
adapted as 2-d parameters too (``target_parameters`` ``gate_proj.weight``: factors and
keys as a module's LoRA), never through ``target_modules``: on a model transformers 5
converts (Qwen3-MoE, OLMoE), peft 0.21 reads ``target_modules`` gate_proj / up_proj /
down_proj as transformers 4's per-expert modules and moves them onto the fused experts
(dropping a dense layer's adapters, refusing gate_proj without up_proj).

``lora.adapter`` reads such a folder back (``lora/peft_io.py``), and one peft made itself
(one rank-r adapter on gate_up_proj, which gate_proj and up_proj share: A_gate = A_up =
A_e, B_gate and B_up its rows), onto the per-expert adapters.
"""

from __future__ import annotations

import torch

from parallel3d.lora.peft_io import EXPERT_FACTOR, FUSED, MLP, wrapper_name


def fused_targets(targets) -> dict[str, tuple[str, ...]]:
    """Each fused parameter that ``targets`` (``lora.targets``) adapts -> the projections of
    ours it joins, in the order the experts module registers the parameters."""
    out = {}
    for param, projections in FUSED.items():
        held = tuple(p for p in projections if p in targets)
        if held:
            out[param] = held
    return out


def expert_config(names, lora) -> dict:
    """The keys of ``adapter_config.json`` for a folder of ``names`` (ours, the experts
    fused) with adapters on the fused experts: the attention's ``target_modules``, the
    ``target_parameters`` (the fused experts', then the other MLP projections' that
    ``names`` holds), and gate_up_proj's rank and alpha when it joins two adapters."""
    fused = fused_targets(lora.targets)
    joined = {f"experts.{p}": len(held) for p, held in fused.items() if len(held) > 1}
    plain = [p for p in MLP if any(n.endswith(f".{p}.lora_A.weight") for n in names)]  # dense, shared expert
    return {"target_modules": sorted(t for t in lora.targets if t not in MLP),
            "target_parameters": [f"experts.{p}" for p in fused] + [f"{p}.weight" for p in plain],
            "rank_pattern": {k: n * lora.rank for k, n in joined.items()},
            "alpha_pattern": {k: n * lora.alpha for k, n in joined.items()}}


def fuse_experts(full: dict[str, torch.Tensor], n_experts: int, lora) -> dict:
    """Replace, in ``full`` (our names -> whole tensors), every routed expert's factors by
    those of transformers' fused parameters, under the names whose PEFT keys peft gives
    them (the module docstring's layout). Returns :func:`expert_config`'s keys, or {} when
    there were none."""
    layers: dict[str, dict] = {}
    for name, m in [(n, EXPERT_FACTOR.fullmatch(n)) for n in list(full)]:
        if m:
            layers.setdefault(m[1], {})[(int(m[2]), m[3], m[4])] = full.pop(name)
    fused = fused_targets(lora.targets)
    for stem, factors in sorted(layers.items()):
        for param, held in fused.items():
            wrapper = wrapper_name(stem, param, list(fused))
            a, b = _fused_factors(factors, n_experts, param, held, stem)
            full[f"{wrapper}.lora_A.weight"], full[f"{wrapper}.lora_B.weight"] = a, b
    return expert_config(full, lora) if layers else {}


def _fused_factors(factors: dict, n_experts: int, param: str, held: tuple[str, ...],
                   stem: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(A (R E, in), B (out, R E)) of ``param`` from the experts' ``factors`` ((expert,
    projection, "A" or "B") -> tensor) of the ``held`` projections, rank r each, R = r len(held)."""
    missing = [(e, p) for e in range(n_experts) for p in held if (e, p, "A") not in factors
               or (e, p, "B") not in factors]
    if missing:  # the senders' rule (peft._blocks) missed a rank: a bug, not the user's input
        raise RuntimeError(f"{stem}: the adapters of (expert, projection) {missing} did not reach rank 0")
    r, width = factors[(0, held[0], "A")].shape
    rows, dtype = factors[(0, held[0], "B")].shape[0], factors[(0, held[0], "A")].dtype
    parts = FUSED[param]
    a = torch.zeros(n_experts, len(held) * r, width, dtype=dtype)  # (E, R, in)
    b = torch.zeros(len(parts) * rows, len(held) * r, n_experts, dtype=dtype)  # (out, R, E)
    for e in range(n_experts):
        for k, proj in enumerate(held):
            start = parts.index(proj) * rows  # gate_up_proj: the gate's rows, then the up's
            a[e, k * r:(k + 1) * r] = factors[(e, proj, "A")]
            b[start:start + rows, k * r:(k + 1) * r, e] = factors[(e, proj, "B")]
    return a.reshape(-1, width), b.reshape(b.shape[0], -1)
