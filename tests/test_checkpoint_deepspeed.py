"""A DeepSpeed ZeRO-2 checkpoint, written here by a 2-rank DeepSpeed run of a Hugging Face
Llama, converts to Hugging Face and to parallel3d with DeepSpeed's own weights and Adam
moments (as DeepSpeed's ``safe_get_full_*`` gathers them from the live engine)."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from parallel3d.checkpoint.convert import convert
from parallel3d.checkpoint.reader import CheckpointReader, find_checkpoint
from parallel3d.models.llama.hf import name_from_hf

pytest.importorskip("deepspeed")
transformers = pytest.importorskip("transformers")


def _deepspeed_zero2_run(out_dir: str) -> dict:
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    # DeepSpeed JIT-compiles a shared-memory all-reduce for CPU ranks on first use (about
    # 150 s on 2 cores, uncached in CI); marking it incompatible makes it use the gloo
    # group it is given, which is all this test needs.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    cfg = transformers.LlamaConfig(vocab_size=521, hidden_size=64, intermediate_size=160,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    ds_config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                 "gradient_clipping": 0.0, "zero_optimization": {"stage": 2},
                 "steps_per_print": 10**6}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    g = torch.Generator().manual_seed(torch.distributed.get_rank())
    for _ in range(3):
        tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=g)
        loss = engine(input_ids=tokens, labels=tokens).loss
        engine.backward(loss)
        engine.step()
    engine.save_checkpoint(out_dir, tag="global_step3")
    if torch.distributed.get_rank() == 0:
        cfg.save_pretrained(out_dir)  # config.json beside the checkpoint, as HF's Trainer does
    reference = {}
    for name, p in engine.module.named_parameters():  # collectives: every rank calls them
        reference[name] = {"master": safe_get_full_fp32_param(p).clone(),
                           "exp_avg": safe_get_full_optimizer_state(p, "exp_avg").clone(),
                           "exp_avg_sq": safe_get_full_optimizer_state(p, "exp_avg_sq").clone()}
    return reference


def test_deepspeed_zero2_converts_to_hf_and_parallel3d(pools, tmp_path):
    ds_dir = tmp_path / "ds"
    reference = pools(2).run(_deepspeed_zero2_run, str(ds_dir))[0]
    assert sorted(p.name for p in (ds_dir / "global_step3").iterdir()) == [
        "mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    convert(ds_dir, tmp_path / "hf", "hf", progress=False)
    convert(ds_dir, tmp_path / "p3d", "parallel3d", progress=False)
    hf = {}
    for f in (tmp_path / "hf").glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            hf.update({k: st.get_tensor(k) for k in st.keys()})
    assert sorted(hf) == sorted(reference)
    with CheckpointReader(find_checkpoint(tmp_path / "p3d")) as p3d:
        assert p3d.index.step == 3 and p3d.index.trainer["optimizer"]["step"] == 3
        for name, ref in reference.items():
            ours = name_from_hf(name)
            assert torch.equal(hf[name], ref["master"]), name
            assert torch.equal(p3d.read("model/" + ours), ref["master"]), name
            for moment in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(p3d.read(f"optim/{moment}/{ours}"), ref[moment]), (name, moment)
    # the exported folder is a working transformers model
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert torch.equal(model.model.embed_tokens.weight.detach(), reference["model.embed_tokens.weight"]["master"])
