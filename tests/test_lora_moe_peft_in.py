"""A PEFT folder whose adapters are on a Mixture-of-Experts model's fused experts
(``target_parameters``, ``checkpoint/foreign/peft_experts.py``) read as ``lora.adapter``
(``lora/peft_io.py``) onto the per-expert adapters of rank r.

A folder peft made itself (one rank-r adapter on gate_up_proj, shared by gate_proj and
up_proj) gives parallel3d peft's logits before training (fp32, 1e-5 of the largest;
measured 3.5e-7 to 6.3e-7) on Qwen2-MoE, Qwen3-MoE and OLMoE at one process, and at dp 2 x
ep 2 (ZeRO 3 too) and tp 2 x dp 2 x ep 2; the run's own export (gate_up_proj at rank 2r, B block-diagonal) reads back to the
exporting run's logits (bit for bit); a folder that no rank-r adapters per projection hold
(B not block-diagonal, a projection lora.targets lacks with non-zero rows, another rank or
scaling) is refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from parallel3d.config import config_from_dict
from parallel3d.errors import UserError
from parallel3d.topology import Topology
from parallel3d.train.trainer import Trainer

from test_lora_moe_peft import ALPHA, FFN, N_EXPERTS, PREFIX, RANK, TARGETS, TOKENS, VOCAB, _hf_base, _job, _train

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore:The following (rank|alpha)_pattern keys did not match")]

FUSED_AND_MLP = ["experts.gate_up_proj", "experts.down_proj", "gate_proj.weight", "up_proj.weight", "down_proj.weight"]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return _hf_base(tmp_path_factory.mktemp("qwen2_moe"))


def _peft_folder(base: Path, folder: Path, target_parameters=FUSED_AND_MLP, zero_up: bool = False) -> dict:
    """peft's own folder on ``base``: rank r on q_proj, v_proj and ``target_parameters``, every
    lora_B drawn at random (peft starts them at zero); ``zero_up``: up_proj's rows of the fused
    gate_up_proj's B zeroed. Returns its logits on TOKENS, with and without the experts'
    adapters."""
    model = transformers.AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    config = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=["q_proj", "v_proj"],
                             target_parameters=list(target_parameters))
    tuned = peft.get_peft_model(model, config).eval()
    draw = torch.Generator().manual_seed(17)
    with torch.no_grad():
        for name, p in sorted(tuned.named_parameters()):
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=draw) * 0.1)
        for module in tuned.modules():  # peft's ParamWrapper of each layer's fused gate_up_proj
            if zero_up and getattr(module, "parameter_name", None) == "gate_up_proj":
                module.lora_B["default"].weight[FFN:] = 0.0
        logits = tuned(input_ids=TOKENS).logits
    tuned.save_pretrained(str(folder))
    with torch.no_grad():
        for name, p in tuned.named_parameters():
            if ".experts." in name and "lora_B" in name:
                p.zero_()
        no_experts = tuned(input_ids=TOKENS).logits
    return {"folder": folder, "logits": logits, "no_experts": no_experts}


def _read_logits(job: dict) -> torch.Tensor:
    """The logits on TOKENS of ``job``'s model as built (its adapters from ``lora.adapter``),
    before any step; every rank computes the whole batch (at tp its slice of the vocabulary,
    in tp rank order)."""
    cfg = config_from_dict(job)
    trainer = Trainer(cfg, Topology.of(cfg.parallel))
    trainer.model.eval()
    with torch.no_grad():
        logits = trainer.model(TOKENS)[..., :VOCAB]
    trainer.close(finished=False)
    return logits


def _reading(corpus_dir, run_dir: Path, base: Path, folder: Path, targets=TARGETS, **parallel) -> dict:
    job = _job(corpus_dir, run_dir, base, targets, **parallel)
    job["lora"]["adapter"] = str(folder)
    job["checkpoint"] = {}
    return job


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


@pytest.fixture(scope="module")
def made(base, tmp_path_factory):
    return _peft_folder(base, tmp_path_factory.mktemp("peft") / "adapter")


@pytest.mark.parametrize("family", ["qwen2_moe", "qwen3_moe", "olmoe"])
def test_a_folder_peft_made_gives_its_logits(made, corpus_dir, base, tmp_path, family):
    """gate_up_proj's one rank-r adapter is gate_proj's and up_proj's (A shared, B's rows),
    down_proj's is down_proj's; the dense layer's and shared expert's as modules' LoRA:
    parallel3d's logits before training are peft's (the experts' adapters matter: without
    them peft's logits are elsewhere). Qwen2-MoE (a dense layer, shared experts), Qwen3-MoE
    (a dense layer), OLMoE (every layer sparse)."""
    if family != "qwen2_moe":
        base = _hf_base(tmp_path / family, family)
        made = _peft_folder(base, tmp_path / "adapter")
    config = json.loads((made["folder"] / "adapter_config.json").read_text())
    assert sorted(config["target_parameters"]) == sorted(FUSED_AND_MLP) and not config["rank_pattern"]
    got = _read_logits(_reading(corpus_dir, tmp_path, base, made["folder"]))
    assert _rel(got, made["logits"]) < 1e-5, _rel(got, made["logits"])
    assert _rel(made["no_experts"], made["logits"]) > 1e-3


@pytest.mark.parametrize("parallel", [{"dp": 2, "ep": 2}, {"dp": 2, "ep": 2, "zero": 3},
                                      {"tp": 2, "dp": 2, "ep": 2}],
                         ids=lambda p: "-".join(f"{k}{v}" for k, v in p.items()))
def test_a_folder_peft_made_reads_at_every_layout(pools, made, corpus_dir, base, tmp_path, parallel):
    """Each rank reads its ep rank's experts (their rows of A, columns of B) and its tp
    slice of the dense factors (under ZeRO 3 bucket by bucket): every rank's logits are peft's."""
    world = parallel.get("tp", 1) * parallel["dp"]
    ranks = pools(world).run(_read_logits, _reading(corpus_dir, tmp_path, base, made["folder"], **parallel))
    tp = parallel.get("tp", 1)
    for rank, got in enumerate(ranks):
        width = VOCAB // tp  # tp rank = rank % tp
        want = made["logits"][..., rank % tp * width:(rank % tp + 1) * width]
        assert got.shape == want.shape and _rel(got, want) < 1e-5, (rank, _rel(got, want))


def _experts_read(job: dict) -> dict[str, set]:
    """The experts whose columns of a fused lora_B (the expert its fast axis) and whose rows of
    a fused lora_A this rank read while building ``job``'s model."""
    import safetensors

    real, seen = safetensors.safe_open, {"A": set(), "B": set()}

    class Slice:
        def __init__(self, inner, key):
            self.inner, self.key = inner, key

        def get_shape(self):
            return self.inner.get_shape()

        def __getitem__(self, index):
            fused = ".experts.lora_" in self.key or ".experts.base_layer.lora_" in self.key
            if fused:
                which = "B" if "lora_B" in self.key else "A"
                span = index[1] if which == "B" else index  # B's columns, A's rows
                size = self.inner.get_shape()[1 if which == "B" else 0]  # R x the experts
                start, stop, _ = span.indices(size)
                seen[which] |= {c % N_EXPERTS if which == "B" else c // (size // N_EXPERTS) for c in range(start, stop)}
            return self.inner[index]

    class File:
        def __init__(self, *a, **k):
            self.inner = real(*a, **k)

        def __enter__(self):
            self.inner.__enter__()
            return self

        def __exit__(self, *exc):
            return self.inner.__exit__(*exc)

        def keys(self):
            return self.inner.keys()

        def get_slice(self, key):
            return Slice(self.inner.get_slice(key), key)

    safetensors.safe_open = File
    try:
        _read_logits(job)
    finally:
        safetensors.safe_open = real
    return seen


def test_each_ep_rank_reads_only_its_experts_factors(pools, made, corpus_dir, base, tmp_path):
    """At dp 2 x ep 2 a rank reads its own 4 experts' rows of the fused A and columns of the
    fused B, not the others': the two ranks' sets are disjoint and cover the 8 experts."""
    ranks = pools(2).run(_experts_read, _reading(corpus_dir, tmp_path, base, made["folder"], dp=2, ep=2))
    for which in ("A", "B"):
        mine = [r[which] for r in ranks]
        assert all(len(m) == N_EXPERTS // 2 for m in mine) and not mine[0] & mine[1], (which, mine)
        assert mine[0] | mine[1] == set(range(N_EXPERTS)), (which, mine)


def test_the_runs_own_export_reads_back(corpus_dir, base, tmp_path):
    """checkpoint.export_peft's folder (gate_up_proj at rank 2r, rank_pattern, block-diagonal
    B) as lora.adapter: the exporting run's logits after training."""
    run = _train(_job(corpus_dir, tmp_path / "run", base))
    config = json.loads((run["folder"] / "adapter_config.json").read_text())
    assert config["rank_pattern"] == {"experts.gate_up_proj": 2 * RANK}
    got = _read_logits(_reading(corpus_dir, tmp_path / "read", base, run["folder"]))
    assert _rel(got, run["logits"]) < 1e-5, _rel(got, run["logits"])


def test_one_of_gate_and_up_reads_when_the_others_rows_are_zero(corpus_dir, base, tmp_path):
    """lora.targets without up_proj: a peft folder whose gate_up_proj's up rows are zero is
    gate_proj's adapter (peft's logits); with up's rows non-zero it is refused in one line."""
    targets = ["q_proj", "v_proj", "gate_proj", "down_proj"]
    params = ["experts.gate_up_proj", "experts.down_proj", "gate_proj.weight", "down_proj.weight"]
    zeroed = _peft_folder(base, tmp_path / "zeroed", params, zero_up=True)
    got = _read_logits(_reading(corpus_dir, tmp_path / "a", base, zeroed["folder"], targets))
    assert _rel(got, zeroed["logits"]) < 1e-5, _rel(got, zeroed["logits"])
    full = _peft_folder(base, tmp_path / "full", params)
    with pytest.raises(UserError, match=r"adapts up_proj \(its rows are not zero\).*add up_proj") as err:
        _read_logits(_reading(corpus_dir, tmp_path / "b", base, full["folder"], targets))
    assert "\n" not in str(err.value)


def _rewrite(folder: Path, out: Path, change) -> Path:
    """A copy of ``folder`` with ``change(tensors, config)`` applied."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(folder / "adapter_model.safetensors"))
    config = json.loads((folder / "adapter_config.json").read_text())
    change(tensors, config)
    out.mkdir(parents=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def exported(corpus_dir, base, tmp_path_factory):
    """checkpoint.export_peft's folder of non-zero adapters (filled, not trained)."""
    return _train(_job(corpus_dir, tmp_path_factory.mktemp("export"), base))["filled"]


def test_a_fused_b_not_block_diagonal_is_refused(exported, corpus_dir, base, tmp_path):
    """gate_up_proj at rank 2r whose gate rows read up's columns: no pair of rank-r
    adapters holds it; refused in one line, before any step."""
    def mix(tensors, config):
        b = tensors[f"{PREFIX}2.mlp.experts.base_layer.lora_B.weight"].view(2 * FFN, 2 * RANK, N_EXPERTS)
        b[:FFN, RANK:, 5] = 0.01  # expert 5: gate's rows, up's columns

    folder = _rewrite(exported, tmp_path / "mixed", mix)
    with pytest.raises(UserError, match="not block-diagonal.*merge_and_unload") as err:
        _read_logits(_reading(corpus_dir, tmp_path, base, folder))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("rank_pattern, alpha_pattern, match", [
    ({"experts.gate_up_proj": 3 * RANK}, {"experts.gate_up_proj": 3 * ALPHA}, "rank 12, alpha 24.0"),
    ({"experts.gate_up_proj": 2 * RANK}, {}, "rank 8, alpha 8.0"),
    ({"experts.down_proj": 2 * RANK}, {}, "rank_pattern gives experts.down_proj 8, not lora.rank 4"),
    ({}, {"q_proj": 2 * ALPHA}, "alpha_pattern gives q_proj 16.0, not lora.alpha 8.0"),
], ids=["rank-3r", "alpha-not-scaled", "down-2r", "attention-alpha"])
def test_patterns_no_rank_r_adapter_holds_are_refused(exported, corpus_dir, base, tmp_path, rank_pattern,
                                                       alpha_pattern, match):
    """rank_pattern / alpha_pattern: gate_up_proj at r or 2r with the scaling alpha / r,
    every other adapter at r and alpha; anything else is refused in one line."""
    def patterns(tensors, config):
        config["rank_pattern"], config["alpha_pattern"] = rank_pattern, alpha_pattern

    folder = _rewrite(exported, tmp_path / "patterned", patterns)
    with pytest.raises(UserError, match=match) as err:
        _read_logits(_reading(corpus_dir, tmp_path, base, folder))
    assert "\n" not in str(err.value)


FUSED_ONLY = ["experts.gate_up_proj", "experts.down_proj"]
NOT_V, NOT_DOWN = ["q_proj", "gate_proj", "up_proj", "down_proj"], ["q_proj", "v_proj", "gate_proj", "up_proj"]
UP_DOWN = ["q_proj", "v_proj", "up_proj", "down_proj"]


@pytest.mark.parametrize("target_parameters, targets, match", [
    (FUSED_AND_MLP, NOT_DOWN, r"adapt .*'down_proj'.*: set lora.targets to that list"),
    (FUSED_AND_MLP, UP_DOWN, r"adapt .*'gate_proj'.*: set lora.targets to that list$"),  # gate_proj.weight
    (FUSED_AND_MLP, NOT_V, r"set lora.targets to that list$"),
    (FUSED_ONLY, ["q_proj", "v_proj", "down_proj"], r"that list \(or without one of \['gate_proj', 'up_proj'\] whose"),
    (FUSED_ONLY + ["experts.router"], TARGETS, r"target_parameters \['experts.router'\] are not read"),
    (FUSED_AND_MLP, TARGETS, None), (FUSED_ONLY, TARGETS, None), (FUSED_ONLY, UP_DOWN, None),
], ids=["no-down", "no-gate-dense", "no-v", "neither-of-gate-up", "unknown", "all", "fused", "up-of-gate-up"])
def test_lora_targets_must_be_what_the_folder_adapts(corpus_dir, base, tmp_path, target_parameters, targets, match):
    """lora.targets against target_modules + the projections target_parameters imply
    (experts.gate_up_proj: gate_proj or up_proj or both, the other's rows then zero;
    experts.down_proj, gate_proj.weight, ...: their own); accepted, or refused in one line."""
    from parallel3d.lora.peft_io import check_adapter_config

    hf = {"r": RANK, "lora_alpha": ALPHA, "target_modules": ["q_proj", "v_proj"],
          "target_parameters": target_parameters}
    lora = config_from_dict(_job(corpus_dir, tmp_path, base, targets)).lora
    if match is None:
        check_adapter_config(hf, lora, tmp_path)
        return
    with pytest.raises(UserError, match=match):
        check_adapter_config(hf, lora, tmp_path)
