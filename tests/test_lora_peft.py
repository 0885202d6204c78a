"""LoRA and PEFT folders in one process: an adapter made by ``peft`` itself gives peft's
logits and loss, one of another rank (or none) is refused before any worker starts, an
exported adapter loaded by peft gives the trained logits; bad ``[lora]`` settings say what
to change. At tp and across ranks: tests/test_lora.py."""

from __future__ import annotations

import pytest
import torch

from parallel3d.config import config_from_dict
from parallel3d.errors import UserError
from parallel3d.topology import Topology
from parallel3d.train.trainer import Trainer

from helpers import tiny_job
from test_lora import RANK, TARGETS, _job, _make_peft_adapter


@pytest.mark.parametrize("change, says", [
    ({"lora": {"rank": 4, "dropout": 1.0}}, "lora.dropout 1.0 is outside [0, 1)"),
    ({"lora": {"rank": 4, "targets": ["q_prj"]}}, "did you mean 'q_proj'"),
    ({"lora": {"rank": 4, "trainable": ["norms"]}}, "did you mean 'norm'"),
])
def test_bad_lora_settings_say_what_to_change(change, says):
    from parallel3d.lora import lora_problems

    job = tiny_job("", "")
    for section, keys in change.items():
        job.setdefault(section, {}).update(keys)
    problems = lora_problems(config_from_dict(job))
    assert any(says in p for p in problems), problems


def test_peft_adapter_gives_peft_logits_and_loss(tmp_path):
    """A PEFT folder made by ``peft`` (``init_lora_weights=False``: B is not zero) on a
    transformers Llama; parallel3d's model with the same base weights and ``lora.adapter``
    gives peft's logits and loss (fp32, 1e-5)."""
    pytest.importorskip("peft")
    from safetensors.torch import load_file

    from parallel3d.lora import apply_lora, start_adapters_
    from parallel3d.models.llama.hf import name_from_hf
    from parallel3d.models.llama.sharded_init import build_sharded_llama
    from parallel3d.train.setup import resolve_model_config

    job = config_from_dict(tiny_job("", str(tmp_path), lora={"rank": RANK, "alpha": 8.0, "targets": TARGETS,
                                                            "adapter": str(tmp_path / "adapter")}))
    model_cfg = resolve_model_config(job.model)
    wrapped = _make_peft_adapter(tmp_path, model_cfg)

    topo = Topology.of(job.parallel, rank=0, world_size=1, create_groups=False)
    model, loss_fn = build_sharded_llama(model_cfg, topo, job.parallel, seed=None)  # the trainer's build
    state = load_file(str(tmp_path / "base" / "model.safetensors"))
    model.load_state_dict({name_from_hf(k): v for k, v in state.items()}, strict=True)
    apply_lora(model, job, topo)
    start_adapters_(model, job.lora, seed=1)

    tokens = torch.randint(0, model_cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = wrapped(input_ids=tokens, labels=tokens)
        logits = model(tokens)
        loss = loss_fn(logits[:, :-1].contiguous(), tokens[:, 1:])  # on a copy of the logits
    torch.testing.assert_close(logits, want.logits, rtol=1e-5, atol=1e-5)
    assert float(loss) == pytest.approx(float(want.loss), rel=1e-5)
    # the adapters matter here: the base model's logits are elsewhere
    with wrapped.disable_adapter(), torch.no_grad():
        assert (wrapped(input_ids=tokens).logits - want.logits).abs().max() > 1e-3


def test_a_mismatched_adapter_folder_fails_before_any_worker_starts(tmp_path):
    """``check_job`` (the launching process, before workers) reads ``lora.adapter``'s
    adapter_config.json against ``[lora]``: a folder of another rank, or none, in one line."""
    import json

    from parallel3d.train.setup import check_job, resolve_model_config

    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 16,
                                                              "target_modules": ["q_proj", "v_proj"]}))
    for folder, match in ((tmp_path, "lora.adapter .*set lora.rank=4"), (tmp_path / "none", "no adapter_config.json")):
        cfg = config_from_dict(tiny_job("", "", lora={"rank": 8, "alpha": 16.0, "targets": ["q_proj", "v_proj"],
                                                      "adapter": str(folder)}))
        with pytest.raises(UserError, match=match):
            check_job(cfg, resolve_model_config(cfg.model), 1)


def test_an_adapter_of_another_rank_says_what_to_change(tmp_path):
    import json

    from parallel3d.lora.peft_io import check_adapter_config

    job = config_from_dict(tiny_job("", "", lora={"rank": 8, "targets": ["q_proj", "v_proj"]}))
    with pytest.raises(UserError, match="set lora.rank=4"):
        check_adapter_config(json.loads(json.dumps({"r": 4, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]})),
                             job.lora, tmp_path)


def _hf_base(job: dict):
    """The transformers Llama with the seeded base weights of ``job`` (the same at any
    layout: the counter-based init), built whole in this process."""
    import transformers

    from parallel3d.models.llama.hf import config_to_hf, name_to_hf
    from parallel3d.models.llama.sharded_init import build_sharded_llama
    from parallel3d.train.setup import resolve_model_config

    cfg = config_from_dict(job)
    model_cfg = resolve_model_config(cfg.model)
    one = Topology.of(cfg.parallel, rank=0, world_size=1, create_groups=False)
    model, _ = build_sharded_llama(model_cfg, one, cfg.parallel, seed=cfg.train.seed)
    hf_cfg = transformers.LlamaConfig(**config_to_hf(model_cfg))
    hf_cfg._attn_implementation = "sdpa"
    hf = transformers.LlamaForCausalLM(hf_cfg)
    hf.load_state_dict({name_to_hf(n): t for n, t in model.state_dict().items()}, strict=True)
    return hf.eval()


def test_exported_adapter_gives_the_trained_logits_in_peft(corpus_dir, tmp_path):
    """After training, ``export_peft``'s folder loaded by peft onto the base gives
    parallel3d's logits (fp32, 1e-5)."""
    peft = pytest.importorskip("peft")
    from parallel3d.checkpoint.foreign.peft import export_peft

    job = _job(corpus_dir, str(tmp_path))
    cfg = config_from_dict(job)
    trainer = Trainer(cfg, Topology.of(cfg.parallel))
    trainer.fit()
    export_peft(trainer.model, cfg.lora, tmp_path / "adapter", trainer.topo, optimizer=trainer.optimizer)
    tuned = peft.PeftModel.from_pretrained(_hf_base(job), str(tmp_path / "adapter")).eval()
    tokens = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = trainer.model(tokens)
        got = tuned(input_ids=tokens).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with tuned.disable_adapter(), torch.no_grad():  # the trained adapters matter
        assert (tuned(input_ids=tokens).logits - want).abs().max() > 1e-3
