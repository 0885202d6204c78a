"""A DeepSpeed ZeRO-3 checkpoint, written here by a 2-rank DeepSpeed run of a Hugging Face
Llama, converts to Hugging Face and parallel3d with DeepSpeed's own fp32 weights and Adam
moments (gathered from the live engine by DeepSpeed's ``safe_get_full_*``), and the export
gives transformers the logits of the DeepSpeed model."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from parallel3d.checkpoint.convert import convert
from parallel3d.checkpoint.foreign.deepspeed import DeepSpeedCheckpoint
from parallel3d.checkpoint.errors import CheckpointError
from parallel3d.checkpoint.reader import CheckpointReader, find_checkpoint
from parallel3d.models.llama.hf import name_from_hf

pytest.importorskip("deepspeed")
transformers = pytest.importorskip("transformers")

TOKENS = torch.arange(24).reshape(2, 12) * 7 % 521


def _zero3_run(out_dir: str) -> dict:
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # use the gloo group given
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    # 521 x 64 and the other shapes are odd over 2 ranks: ZeRO-3 pads the last partition
    cfg = transformers.LlamaConfig(vocab_size=521, hidden_size=64, intermediate_size=162,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    ds_config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                 "gradient_clipping": 0.0, "steps_per_print": 10**6,
                 "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    g = torch.Generator().manual_seed(torch.distributed.get_rank())
    for _ in range(2):
        tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=g)
        engine.backward(engine(input_ids=tokens, labels=tokens).loss)
        engine.step()
    engine.save_checkpoint(out_dir, tag="global_step2")
    if torch.distributed.get_rank() == 0:
        cfg.save_pretrained(out_dir)
    reference = {}
    for name, p in engine.module.named_parameters():  # collectives: every rank calls them
        reference[name] = {"master": safe_get_full_fp32_param(p).clone(),
                           "exp_avg": safe_get_full_optimizer_state(p, "exp_avg").clone(),
                           "exp_avg_sq": safe_get_full_optimizer_state(p, "exp_avg_sq").clone()}
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        with torch.no_grad():
            reference["logits"] = engine.module(input_ids=TOKENS).logits.clone()
    return reference


@pytest.fixture(scope="module")
def zero3(pools, tmp_path_factory):
    ds_dir = tmp_path_factory.mktemp("zero3") / "ds"
    return ds_dir, pools(2).run(_zero3_run, str(ds_dir))[0]


def test_zero3_converts_to_hf_bit_identical_with_equal_logits(zero3, tmp_path):
    ds_dir, reference = zero3
    files = sorted(p.name for p in (ds_dir / "global_step2").iterdir())
    assert "zero_pp_rank_1_mp_rank_00_optim_states.pt" in files and "mp_rank_00_model_states.pt" not in files
    convert(ds_dir, tmp_path / "hf", "hf", progress=False)
    hf = {}
    for f in (tmp_path / "hf").glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            hf.update({k: st.get_tensor(k) for k in st.keys()})
    assert sorted(hf) == sorted(k for k in reference if k != "logits")
    for name, ref in reference.items():
        if name != "logits":
            assert torch.equal(hf[name], ref["master"]), name
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    with torch.no_grad():
        assert torch.equal(model(input_ids=TOKENS).logits, reference["logits"])


def test_zero3_moments_and_step_convert_to_parallel3d(zero3, tmp_path):
    ds_dir, reference = zero3
    convert(ds_dir, tmp_path / "p3d", "parallel3d", progress=False)
    with CheckpointReader(find_checkpoint(tmp_path / "p3d")) as p3d:
        assert p3d.index.step == 2 and p3d.index.trainer["optimizer"]["step"] == 2
        for name, ref in reference.items():
            if name == "logits":
                continue
            ours = name_from_hf(name)
            for moment in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(p3d.read(f"optim/{moment}/{ours}"), ref[moment]), (name, moment)


def test_zero3_with_a_rank_file_missing_is_refused_in_one_line(zero3, tmp_path):
    import shutil

    ds_dir, _ = zero3
    copy = tmp_path / "ds"
    shutil.copytree(ds_dir, copy)
    (copy / "global_step2" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(CheckpointError, match="1 optimizer files for 2 ranks"):
        DeepSpeedCheckpoint(copy / "global_step2")
