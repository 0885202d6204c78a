"""torch DCP in and out.

In: a Hugging Face Llama trained 2 steps under FSDP2 (``fully_shard``) on 2 gloo ranks and
saved by ``dcp.save`` twice: its plain ``model.state_dict()`` (DTensor shards, Hugging Face
naming), and ``{"model", "optim"}`` from ``get_state_dict`` (Adam state by parameter
name). torchtitan's naming: the same model's weights renamed and q/k-permuted by
torchtitan's own ``Llama3StateDictAdapter.from_hf`` and saved by ``dcp.save`` as
torchtitan's checkpointer does (model keys at the top level). Each converts to Hugging
Face with every tensor bit-identical to the source model's and transformers' logits equal
to the FSDP2 model's; the moments and step convert to parallel3d.

Out: parallel3d -> DCP, then ``dcp.load`` into a fresh Hugging Face model (one process)
and into an FSDP2-wrapped one (2 ranks) gives the source model's logits.
"""

from __future__ import annotations

import pytest
import torch

from parallel3d.checkpoint.convert import convert
from parallel3d.checkpoint.errors import CheckpointError
from parallel3d.checkpoint.reader import CheckpointReader, find_checkpoint

transformers = pytest.importorskip("transformers")

TOKENS = (torch.arange(32).reshape(2, 16) * 13) % 521


def _hf_config():
    return transformers.LlamaConfig(vocab_size=521, hidden_size=64, intermediate_size=160,
                                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                    tie_word_embeddings=False, max_position_embeddings=64)


def _fsdp2_run(root: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(_hf_config())
    mesh = init_device_mesh("cpu", (2,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(torch.distributed.get_rank())
    for _ in range(2):
        tokens = torch.randint(0, 521, (2, 16), generator=g)
        model(input_ids=tokens, labels=tokens).loss.backward()
        opt.step()
        opt.zero_grad()
    dcp.save(model.state_dict(), checkpoint_id=f"{root}/plain")
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=f"{root}/with_optim")
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights, optim = get_state_dict(model, opt, options=full)
    with torch.no_grad():
        logits = model(input_ids=TOKENS).logits
    if torch.distributed.get_rank() != 0:
        return {}  # full state dicts are gathered to rank 0 only
    _hf_config().save_pretrained(root)  # config.json above the DCP folders
    return {"weights": {k: v.clone() for k, v in weights.items()}, "logits": logits,
            "moments": {k: {m: s[m].clone() for m in ("exp_avg", "exp_avg_sq")} for k, s in optim["state"].items()},
            "step": int(next(iter(optim["state"].values()))["step"])}


@pytest.fixture(scope="module")
def fsdp2(pools, tmp_path_factory):
    root = tmp_path_factory.mktemp("fsdp2")
    return root, pools(2).run(_fsdp2_run, str(root))[0]


def _export(folder) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in folder.glob("*.safetensors"):
        out.update(load_file(f))
    return out


def _logits(folder) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    with torch.no_grad():
        return model(input_ids=TOKENS).logits


@pytest.mark.parametrize("which", ["plain", "with_optim"])
def test_fsdp2_dcp_converts_to_hf_bit_identical(fsdp2, tmp_path, which):
    root, ref = fsdp2
    convert(root / which, tmp_path / "hf", "hf", progress=False)
    got = _export(tmp_path / "hf")
    assert sorted(got) == sorted(ref["weights"])
    for name, want in ref["weights"].items():
        assert torch.equal(got[name], want), name
    # the same weights through the same transformers code: equal bits
    assert torch.equal(_logits(tmp_path / "hf"), ref["logits"])


def test_fsdp2_adam_state_converts_with_its_step(fsdp2, tmp_path):
    root, ref = fsdp2
    convert(root / "with_optim", tmp_path / "p3d", "parallel3d", progress=False)
    with CheckpointReader(find_checkpoint(tmp_path / "p3d")) as p3d:
        assert p3d.index.trainer["optimizer"]["step"] == ref["step"] == 2
        assert p3d.index.trainer["optimizer"]["lr"] == 1e-3
        for fqn, moments in ref["moments"].items():
            for m, want in moments.items():
                assert torch.equal(p3d.read(f"optim/{m}/{fqn.removeprefix('model.')}"), want), (fqn, m)


def test_torchtitan_naming_converts_to_hf_bit_identical(tmp_path):
    """torchtitan's own adapter renames and permutes an HF model's weights; dcp.save as
    torchtitan's checkpointer; convert back: the HF tensors come back bit for bit."""
    pytest.importorskip("torchtitan.models.llama3.state_dict_adapter")
    from types import SimpleNamespace as NS

    import torch.distributed.checkpoint as dcp
    from torchtitan.models.common.rope import ComplexRoPE
    from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter

    torch.manual_seed(1)
    hf = transformers.LlamaForCausalLM(_hf_config())
    attention = NS(n_heads=4, n_kv_heads=2, head_dim=16, rope=object.__new__(ComplexRoPE.Config))
    adapter = Llama3StateDictAdapter(NS(dim=64, layers=[NS(attention=attention)] * 2,
                                        enable_weight_tying=False), None)
    titan = adapter.from_hf(hf.state_dict())
    assert "layers.0.attention.qkv_linear.wq.weight" in titan and "lm_head.weight" in titan
    # torchtitan's flattened optimizer state (``state.<fqn>.<moment>``), here moments that
    # are a known function of each weight: they must come out permuted like the weights
    state = {**titan, "train_state.step": torch.tensor(10)}
    for fqn, w in titan.items():
        state[f"optimizer.state.{fqn}.exp_avg"] = w * 2
        state[f"optimizer.state.{fqn}.exp_avg_sq"] = w * w
        state[f"optimizer.state.{fqn}.step"] = torch.tensor(10.0)
    dcp.save(state, checkpoint_id=str(tmp_path / "titan" / "step-10"), no_dist=True)
    _hf_config().save_pretrained(tmp_path / "titan")
    convert(tmp_path / "titan" / "step-10", tmp_path / "hf", "hf", progress=False)
    got = _export(tmp_path / "hf")
    for name, want in hf.state_dict().items():
        assert torch.equal(got[name], want), name
    with torch.no_grad():
        assert torch.equal(_logits(tmp_path / "hf"), hf(input_ids=TOKENS).logits)
    convert(tmp_path / "titan" / "step-10", tmp_path / "p3d", "parallel3d", progress=False)
    with CheckpointReader(find_checkpoint(tmp_path / "p3d")) as p3d:
        assert p3d.index.step == 10 and p3d.index.trainer["optimizer"]["step"] == 10
        for name, w in hf.state_dict().items():
            ours = name.removeprefix("model.")
            assert torch.equal(p3d.read(f"optim/exp_avg/{ours}"), w * 2), name
            assert torch.equal(p3d.read(f"optim/exp_avg_sq/{ours}"), w * w), name


def _fsdp2_load(folder: str) -> torch.Tensor:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(123)  # other weights than the source's: the load must replace them
    model = transformers.LlamaForCausalLM(_hf_config())
    mesh = init_device_mesh("cpu", (2,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    state = model.state_dict()
    dcp.load(state, checkpoint_id=folder)
    model.load_state_dict(state)
    with torch.no_grad():
        return model(input_ids=TOKENS).logits


def test_parallel3d_to_dcp_loads_into_hf_and_fsdp2(fsdp2, pools, tmp_path):
    import torch.distributed.checkpoint as dcp

    root, ref = fsdp2
    convert(root / "plain", tmp_path / "p3d", "parallel3d", progress=False)
    convert(tmp_path / "p3d", tmp_path / "dcp", "dcp", progress=False)
    torch.manual_seed(123)
    model = transformers.LlamaForCausalLM(_hf_config())
    state = model.state_dict()
    dcp.load(state, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    model.load_state_dict(state)
    with torch.no_grad():
        assert torch.equal(model(input_ids=TOKENS).logits, ref["logits"])
    sharded = pools(2).run(_fsdp2_load, str(tmp_path / "dcp"))
    for logits in sharded:
        assert torch.equal(logits, ref["logits"])
    # and the DCP converts back, through torch's own reader's format
    convert(tmp_path / "dcp", tmp_path / "hf", "hf", progress=False)
    for name, want in ref["weights"].items():
        assert torch.equal(_export(tmp_path / "hf")[name], want), name


def test_dcp_refusals_are_one_line(fsdp2, tmp_path):
    import shutil

    root, _ = fsdp2
    broken = tmp_path / "broken"
    shutil.copytree(root / "plain", broken)
    shutil.copy(root / "config.json", tmp_path / "config.json")
    (broken / "__1_0.distcp").unlink()
    with pytest.raises(CheckpointError, match=r"__1_0\.distcp is missing .*lacks a shard file"):
        convert(broken, tmp_path / "a", "hf", progress=False)
    assert not (tmp_path / "a").exists()
    other = tmp_path / "other"
    import torch.distributed.checkpoint as dcp

    dcp.save({"encoder.weight": torch.zeros(2, 2)}, checkpoint_id=str(other), no_dist=True)
    with pytest.raises(CheckpointError, match="DCP checkpoint of an unknown model"):
        convert(other, tmp_path / "b", "hf", progress=False)


def test_tied_qwen2_to_dcp_loads_into_transformers(tmp_path):
    """A tied head (and Qwen2's q/k/v biases): the DCP output also carries lm_head.weight,
    which Hugging Face's state_dict lists and dcp.load asks for."""
    import torch.distributed.checkpoint as dcp

    cfg = transformers.Qwen2Config(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    source = transformers.Qwen2ForCausalLM(cfg)
    source.save_pretrained(tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "dcp", "dcp", progress=False)
    torch.manual_seed(5)
    target = transformers.Qwen2ForCausalLM(cfg)
    state = target.state_dict()
    dcp.load(state, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    target.load_state_dict(state)
    with torch.no_grad():
        assert torch.equal(target(input_ids=TOKENS % 300).logits, source(input_ids=TOKENS % 300).logits)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_an_moe_models_dcp_with_stacked_experts_converts_per_expert(tmp_path, family):
    """transformers 5's ``state_dict()`` of an MoE model stacks each layer's experts
    (``experts.gate_up_proj`` (E, 2f, dim), ``experts.down_proj`` (E, dim, f)); a DCP of
    it converts to Hugging Face's on-disk form, one tensor per expert, bit for bit what
    ``save_pretrained`` writes."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    transformers = pytest.importorskip("transformers")
    small = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1)
    if family == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(**small, intermediate_size=48, moe_intermediate_size=16, num_experts=4,
                                          num_experts_per_tok=2, head_dim=16, mlp_only_layers=[0])
        model = transformers.Qwen3MoeForCausalLM(cfg)
    else:
        cfg = transformers.MixtralConfig(**small, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2)
        model = transformers.MixtralForCausalLM(cfg)
    state = model.state_dict()
    assert any(k.endswith("experts.gate_up_proj") for k in state)  # the stacked form
    model.save_pretrained(tmp_path / "hf")
    dcp.save(state, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    cfg.save_pretrained(tmp_path / "dcp")
    convert(tmp_path / "dcp", tmp_path / "out", "hf", progress=False)
    want, got = (load_file(tmp_path / d / "model.safetensors") for d in ("hf", "out"))
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
