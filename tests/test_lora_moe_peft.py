"""LoRA on a Mixture-of-Experts model's routed experts out as a PEFT folder
(``checkpoint/foreign/peft_experts.py``): after training on a transformers MoE base,
``checkpoint.export_peft`` writes each layer's experts as the fused parameters peft adapts
(``target_parameters``: gate_up_proj at rank 2r, down_proj at r), the dense layers' and
shared expert's MLP as 2-d parameters, the attention as modules;
``peft.PeftModel.from_pretrained`` on the base then gives the trained model's logits (fp32,
1e-5; measured 2.8e-7 to 3.5e-7), with every projection targeted and with some of the
experts' only, on Qwen2-MoE, Qwen3-MoE and OLMoE. At dp 2 x ep 2 and tp 2 x dp 2 x ep 2,
after one process's losses, the same adapters give one process's folder bit for bit,
gathered from every ep rank."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from parallel3d.config import config_from_dict
from parallel3d.topology import Topology
from parallel3d.train.trainer import Trainer

from helpers import relative_diff, tiny_job

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

pytestmark = [pytest.mark.usefixtures("one_thread"),
              # peft 0.21 checks rank_pattern's keys against target_modules only: it applies
              # "experts.gate_up_proj" (rank 2r, scaling alpha / r) and warns it did not
              pytest.mark.filterwarnings("ignore:The following (rank|alpha)_pattern keys did not match")]

STEPS, RANK, ALPHA = 3, 4, 8.0
VOCAB, N_EXPERTS, HIDDEN, FFN = 512, 8, 64, 32
TARGETS = ["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"]
TOKENS = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(5))
PREFIX = "base_model.model.model.layers."


def _hf_base(folder: Path, family: str = "qwen2_moe") -> Path:
    """A random transformers MoE saved to ``folder``, its routers decisive (no near-ties in
    a top-k): Qwen2-MoE (layer 0 dense, layers 1 and 2 sparse with a shared expert),
    Qwen3-MoE (layer 0 dense) or OLMoE (every layer sparse)."""
    t, size = transformers, dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=3, num_attention_heads=4,
                                 num_key_value_heads=2, max_position_embeddings=256)
    moe = dict(num_experts=N_EXPERTS, num_experts_per_tok=2)
    cls, cfg = {
        "qwen2_moe": (t.Qwen2MoeForCausalLM, lambda: t.Qwen2MoeConfig(
            **size, **moe, intermediate_size=96, moe_intermediate_size=FFN, shared_expert_intermediate_size=48,
            mlp_only_layers=[0])),
        "qwen3_moe": (t.Qwen3MoeForCausalLM, lambda: t.Qwen3MoeConfig(
            **size, **moe, intermediate_size=96, moe_intermediate_size=FFN, mlp_only_layers=[0])),
        "olmoe": (t.OlmoeForCausalLM, lambda: t.OlmoeConfig(
            **size, **moe, intermediate_size=FFN, pad_token_id=None, eos_token_id=None)),
    }[family]
    torch.manual_seed(11)
    model = cls(cfg())
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("gate.weight"):
                p.normal_(0.0, 0.3)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return _hf_base(tmp_path_factory.mktemp("qwen2_moe"))


def _job(corpus_dir, run_dir: Path, base: Path, targets=TARGETS, **parallel) -> dict:
    # grad_clip below the steps' norms (0.17-0.22): a factor's gradient summed over the wrong
    # ranks changes the clip coefficient, and so the losses (Adam's update alone would not)
    job = tiny_job(corpus_dir, str(run_dir), train={"steps": STEPS, "lr": 2e-2, "grad_clip": 0.05},
                   parallel=parallel, lora={"rank": RANK, "alpha": ALPHA, "targets": targets},
                   checkpoint={"export_peft": "adapter"})
    job["model"] = {"hf_checkpoint": str(base)}
    return job


def _fill_adapters_(model) -> None:
    """Every adapter factor set to values that depend only on its name and place in the
    whole factor (the counter-based init): the same at any layout, B not zero."""
    from parallel3d.lora.adapters import adapter_parameters
    from parallel3d.tensor_parallel.init import counter_normal_

    with torch.no_grad():
        for name, p in adapter_parameters(model):
            dim = getattr(p, "p3d_tp_dim", None)
            full, start = list(p.shape), 0
            if dim is not None:
                full[dim], start = p.p3d_tp_full, p.p3d_tp_range[0]
            counter_normal_(p, 0.1, seed=3, name=name, full_shape=full, dim=dim, start=start)


def _train(job: dict) -> dict:
    """The run's losses, its logits on TOKENS after training (one process) and its folder
    (``checkpoint.export_peft``); then every adapter filled by :func:`_fill_adapters_` and
    exported again, to ``filled``."""
    from parallel3d.checkpoint.foreign.peft import export_peft

    cfg = config_from_dict(job)
    trainer = Trainer(cfg, Topology.of(cfg.parallel))
    losses = [h["loss"] for h in trainer.fit()]
    run_dir = Path(job["run"]["dir"])
    out = {"losses": losses, "folder": run_dir / "adapter", "filled": run_dir / "filled"}
    if trainer.topo.world_size == 1:
        trainer.model.eval()
        with torch.no_grad():
            out["logits"] = trainer.model(TOKENS)[..., :VOCAB]
    trainer.close()  # writes the trained adapters' folder
    _fill_adapters_(trainer.model)
    export_peft(trainer.model, cfg.lora, out["filled"], trainer.topo, base_model=cfg.model.hf_checkpoint)
    return out


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "adapter_model.safetensors"))


def _check_in_peft(run: dict, base: Path) -> dict[str, float]:
    """peft's logits on ``base`` with ``run``'s folder equal the run's (fp32, 1e-5 of the
    largest); without the adapters, and with the experts' zeroed, they do not. Returns the
    three relative differences."""
    tuned = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32), str(run["folder"])).eval()
    want = run["logits"]

    def diff():
        with torch.no_grad():
            return float((tuned(input_ids=TOKENS).logits - want).abs().max() / want.abs().max())
    got = diff()
    with tuned.disable_adapter():
        without = diff()
    with torch.no_grad():  # the experts' adapters only (peft's fused ParamWrappers) set to zero
        for name, p in tuned.named_parameters():
            if ".experts." in name and "lora_B" in name:
                p.zero_()
    no_experts = diff()
    assert got < 1e-5, got
    assert without > 1e-3 and no_experts > 1e-4, (without, no_experts)
    return {"exact": got, "without": without, "no_experts": no_experts}


@pytest.fixture(scope="module")
def one(corpus_dir, base, tmp_path_factory):
    return _train(_job(corpus_dir, tmp_path_factory.mktemp("one"), base))


def test_expert_adapters_export_as_peft_target_parameters(one, base):
    """Every projection targeted: per sparse layer gate_up_proj at rank 2r (rank_pattern,
    alpha_pattern: the scaling alpha / r) inside down_proj's wrapper at rank r; the dense
    layer's and the shared expert's MLP as 2-d parameters, the attention as modules; peft
    on the base gives the run's logits."""
    config = json.loads((one["folder"] / "adapter_config.json").read_text())
    assert config["target_parameters"] == ["experts.gate_up_proj", "experts.down_proj", "gate_proj.weight",
                                           "up_proj.weight", "down_proj.weight"]
    assert config["rank_pattern"] == {"experts.gate_up_proj": 2 * RANK}
    assert config["alpha_pattern"] == {"experts.gate_up_proj": 2 * ALPHA}
    assert (config["r"], config["lora_alpha"], config["target_modules"]) == (RANK, ALPHA, ["q_proj", "v_proj"])
    tensors = _tensors(one["folder"])
    for layer in (1, 2):
        stem = f"{PREFIX}{layer}.mlp.experts."
        shapes = {k: tuple(tensors[stem + k].shape) for k in (
            "base_layer.lora_A.weight", "base_layer.lora_B.weight", "lora_A.weight", "lora_B.weight")}
        assert shapes == {"base_layer.lora_A.weight": (2 * RANK * N_EXPERTS, HIDDEN),
                          "base_layer.lora_B.weight": (2 * FFN, 2 * RANK * N_EXPERTS),
                          "lora_A.weight": (RANK * N_EXPERTS, FFN),
                          "lora_B.weight": (HIDDEN, RANK * N_EXPERTS)}, shapes
        assert f"{PREFIX}{layer}.mlp.shared_expert.up_proj.lora_B.weight" in tensors
    assert f"{PREFIX}0.mlp.gate_proj.lora_A.weight" in tensors
    assert not any(".experts.0." in k for k in tensors)
    _check_in_peft(one, base)


@pytest.mark.parametrize("family, targets", [
    ("qwen2_moe", ["down_proj"]), ("qwen2_moe", ["gate_proj"]), ("qwen2_moe", ["q_proj", "up_proj", "down_proj"]),
    ("qwen3_moe", ["gate_proj"]), ("qwen3_moe", TARGETS), ("olmoe", ["q_proj", "up_proj"]),
], ids=lambda x: "-".join(x) if isinstance(x, list) else x)
def test_some_expert_projections_export_exactly(corpus_dir, base, tmp_path, family, targets):
    """One of gate_proj and up_proj on gate_up_proj at rank r (the other's rows of B zero,
    no rank_pattern), or down_proj alone; on Qwen3-MoE with a dense layer and on OLMoE too
    (models whose ``target_modules`` peft would reread as transformers 4's experts): peft
    gives the run's logits."""
    if family != "qwen2_moe":
        base = _hf_base(tmp_path / family, family)
    run = _train(_job(corpus_dir, tmp_path, base, targets))
    config = json.loads((run["folder"] / "adapter_config.json").read_text())
    fused = [p for p, ours in (("gate_up_proj", ("gate_proj", "up_proj")), ("down_proj", ("down_proj",)))
             if set(ours) & set(targets)]
    assert config["target_parameters"][:len(fused)] == [f"experts.{p}" for p in fused]
    assert config["target_modules"] == sorted(set(targets) & {"q_proj", "v_proj"})
    two = {"gate_proj", "up_proj"} <= set(targets)
    assert config["rank_pattern"] == ({"experts.gate_up_proj": 2 * RANK} if two else {})
    if targets == ["gate_proj"]:
        b = _tensors(run["folder"])[f"{PREFIX}1.mlp.experts.lora_B.weight"]  # gate_up_proj's, alone
        assert b.shape == (2 * FFN, RANK * N_EXPERTS) and not b[FFN:].any() and b[:FFN].any()
    _check_in_peft(run, base)


@pytest.mark.parametrize("parallel", [{"dp": 2, "ep": 2}, {"tp": 2, "dp": 2, "ep": 2}],
                         ids=lambda p: "-".join(f"{k}{v}" for k, v in p.items()))
def test_export_at_ep_holds_the_one_process_folder(pools, corpus_dir, base, tmp_path, one, parallel):
    """Under expert parallelism the experts' adapters come from every ep rank (and the dense
    ones from dp rank 0, split over tp): after one process's losses (1e-5), the same
    adapters at every layout (filled by name and place, not trained) give one process's
    folder bit for bit, config and every tensor."""
    world = parallel.get("tp", 1) * parallel["dp"]
    ranks = pools(world).run(_train, _job(corpus_dir, tmp_path, base, **parallel))
    assert relative_diff(ranks[0]["losses"], one["losses"]) < 1e-5, (ranks[0]["losses"], one["losses"])
    read = lambda f: json.loads((f / "adapter_config.json").read_text())  # noqa: E731
    assert read(tmp_path / "adapter") == read(one["folder"]) == read(tmp_path / "filled")
    want, got = _tensors(one["filled"]), _tensors(tmp_path / "filled")
    assert sorted(got) == sorted(want) == sorted(_tensors(tmp_path / "adapter"))
    for key, t in want.items():
        assert torch.equal(got[key], t), key
