"""recipes/sft_chat.toml end to end through the command line (issue 19, point 5): a random
Hugging Face Llama with a ChatML tokenizer is the model, `prepare-data --format chat` makes
the data from a small conversation file, `train` runs the recipe (shrunk for CPU) until
the model has learned the conversations, and the exported Hugging Face folder, loaded with
transformers, answers a training prompt with its trained answer under greedy decoding."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from parallel3d.config import load_config
from parallel3d.planner.hardware import FRAGMENTATION, gpu_named, usable_bytes
from parallel3d.train.dryrun import dry_run

from chat_inputs import make_chat_tokenizer, write_jsonl
from chat_models import END, greedy_answer, save_chat_llama
from helpers import write_llama31_8b_config

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "sft_chat.toml"
CONVERSATIONS = [
    ("What colour is the sky?", "Blue, on a clear day."),
    ("Name a prime number.", "Seven."),
    ("Where does the sun rise?", "In the east."),
    ("How many legs has a spider?", "Eight legs."),
    ("What do bees make?", "Honey and wax."),
]


def _cli(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "parallel3d.cli", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> Path:
    """A random Llama saved by transformers, with a ChatML tokenizer in the same folder."""
    return save_chat_llama(tmp_path_factory.mktemp("hf_chat"))


@pytest.fixture(scope="module")
def chat_moe_model(tmp_path_factory) -> Path:
    """A random Qwen3-MoE (4 experts, top 2, layer 0 dense) saved by transformers, with the
    ChatML tokenizer."""
    folder = tmp_path_factory.mktemp("hf_chat_moe")
    make_chat_tokenizer(folder, "chatml")
    cfg = transformers.Qwen3MoeConfig(vocab_size=608, hidden_size=64, intermediate_size=160,
                                      moe_intermediate_size=64, num_experts=4, num_experts_per_tok=2,
                                      mlp_only_layers=[0], norm_topk_prob=True, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      max_position_embeddings=256, tie_word_embeddings=False)
    torch.manual_seed(3)
    transformers.Qwen3MoeForCausalLM(cfg).save_pretrained(folder)
    return folder


@pytest.mark.slow  # ~35 s: prepare-data, a 2-process run, generation
def test_sft_recipe_learns_conversations_and_the_export_answers_them(chat_model, tmp_path):
    _sft_learns_and_answers(chat_model, tmp_path, [])


@pytest.mark.slow  # ~45 s
def test_sft_of_a_qwen3_moe_at_dp2_ep2_exports_a_model_that_answers(chat_moe_model, tmp_path):
    """Issue 31, point 4: the experts split over the two ranks (ep 2), their own optimizer;
    the export is a Qwen3-MoE folder with one tensor per expert that transformers loads."""
    _sft_learns_and_answers(chat_moe_model, tmp_path, ["--parallel.ep=2"])
    out = tmp_path / "run" / "hf"
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen3MoeForCausalLM"]
    from safetensors import safe_open

    with safe_open(out / "model.safetensors", "pt") as f:
        experts = {k for k in f.keys() if ".mlp.experts." in k}
    assert experts == {f"model.layers.1.mlp.experts.{e}.{w}.weight" for e in range(4)
                       for w in ("gate_proj", "up_proj", "down_proj")}


def _sft_learns_and_answers(chat_model: Path, tmp_path: Path, extra: list[str]) -> None:
    rows = []
    for copy in range(12):  # every 5th conversation held out: rotated, so each one is
        for k in range(len(CONVERSATIONS)):  # held out in some copies and trained in others
            i = (k + copy) % len(CONVERSATIONS)
            question, answer = CONVERSATIONS[i]
            system = [{"role": "system", "content": "Answer briefly."}] if (copy + i) % 2 else []
            rows.append({"messages": system + [{"role": "user", "content": question},
                                               {"role": "assistant", "content": answer}]})
    write_jsonl(tmp_path / "chats.jsonl", rows)
    data = tmp_path / "data"
    proc = _cli(["prepare-data", str(tmp_path / "chats.jsonl"), "--format", "chat", "--tokenizer",
                 str(chat_model), "--out", str(data), "--val-fraction", "0.2", "--workers", "1",
                 "--quiet"], timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "no conversation dropped" in proc.stdout, proc.stdout
    run = tmp_path / "run"
    # The recipe's packing, schedule, ZeRO stage, clipping and export as they are; two
    # processes instead of eight, small windows and batches, and a learning rate for a
    # random model that must memorise five answers in 60 steps.
    proc = _cli(["train", str(RECIPE), f"--model.hf_checkpoint={chat_model}", f"--data.path={data}",
                 f"--run.dir={run}", "--parallel.dp=2", "--launch.nproc=2", "--train.steps=60",
                 "--train.seq_len=64", "--train.global_batch=4", "--train.warmup_steps=5",
                 "--train.lr=1e-2", "--train.log_interval=100", "--eval.interval=30",
                 "--eval.batches=1", "--checkpoint.interval=0", *extra], timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["loss"] < 0.1 < records[0]["loss"], [r["loss"] for r in records]
    val = [r["val_loss"] for r in records if "val_loss" in r]
    assert len(val) == 2 and val[1] < 0.1, val  # the held-out copies: the same answers

    out = run / "hf"
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tok = transformers.AutoTokenizer.from_pretrained(out)
    for question, answer in CONVERSATIONS:
        assert greedy_answer(model, tok, question) == answer + END, question


def test_sft_recipe_fits_an_h100_for_llama31_8b(tmp_path):
    """The recipe's comment quotes finetune_hf.toml's per-GPU memory (the same layout,
    seq_len and micro-batch; test_finetune_recipe checks that figure against the planner's
    own output): the same words, and the dry run on Llama 3.1 8B agrees with it to the
    printed precision and fits an H100."""
    import re

    finetune = (RECIPE.parent / "finetune_hf.toml").read_text()
    quoted = re.search(r"predicted at ([\d.]+) GiB per GPU", finetune).group(1)
    assert f"at {quoted} GiB per GPU" in RECIPE.read_text()
    cfg = load_config(RECIPE, [f"--model.hf_checkpoint={write_llama31_8b_config(tmp_path / 'm')}",
                               f"--data.path={tmp_path / 'data'}", "--launch.backend=nccl"])
    found = dry_run(cfg, 8, out=lambda line: None)
    worst = max(s.peak for s in found["stages"]) * (1 + FRAGMENTATION)
    assert f"{worst / 2**30:.1f}" == quoted
    assert worst <= usable_bytes(gpu_named("h100-80g"))
