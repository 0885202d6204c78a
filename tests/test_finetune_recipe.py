"""recipes/finetune_hf.toml through the real command line, the way a user runs it: a random
Hugging Face Llama folder (GQA, an odd vocabulary, its own tokenizer) is the model,
`parallel3d prepare-data --tokenizer MODEL_DIR` makes the data, and `parallel3d train` runs
the recipe at its own layout (8 processes, dp 8, ZeRO-2). The loss goes down, and the
Hugging Face folder the run leaves holds exactly the final checkpoint's weights, which
transformers loads."""

from __future__ import annotations

import hashlib
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from parallel3d.checkpoint.reader import CheckpointReader, find_checkpoint
from parallel3d.cli import main as cli_main
from parallel3d.config import load_config
from parallel3d.data.format import open_dataset
from parallel3d.models.llama.hf import name_from_hf
from parallel3d.planner.hardware import FRAGMENTATION, gpu_named, usable_bytes
from parallel3d.planner.spec import Layout
from parallel3d.train.dryrun import dry_run

from data_inputs import make_mixed_inputs, make_tokenizer
from helpers import write_llama31_8b_config

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "finetune_hf.toml"
TOKENIZER_VOCAB = 300
MODEL_VOCAB = 301  # odd, and one id the tokenizer never emits (as padded HF vocabularies)
STEPS = 12
SEQ = 32

@pytest.fixture(scope="module")
def hf_model(tmp_path_factory) -> Path:
    """A random Llama saved by transformers, with its tokenizer in the same folder."""
    folder = tmp_path_factory.mktemp("hf_llama")
    make_tokenizer(folder, TOKENIZER_VOCAB)
    cfg = transformers.LlamaConfig(vocab_size=MODEL_VOCAB, hidden_size=64, intermediate_size=160,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=256, tie_word_embeddings=False)
    torch.manual_seed(5)
    transformers.LlamaForCausalLM(cfg).save_pretrained(folder)
    return folder


def _cli(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "parallel3d.cli", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def _causal_lm_loss(model, windows: torch.Tensor) -> float:
    with torch.no_grad():
        logits = model(windows[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten()).item()


def test_finetune_recipe_lowers_the_loss_and_leaves_a_hf_folder(hf_model, tmp_path):
    make_mixed_inputs(tmp_path / "text", 200_000)
    data = tmp_path / "data"
    proc = _cli(["prepare-data", str(tmp_path / "text"), "--tokenizer", str(hf_model), "--out", str(data),
                 "--val-fraction", "0.1", "--workers", "1", "--quiet"], timeout=120)
    assert proc.returncode == 0, proc.stderr
    run = tmp_path / "run"
    # The recipe's layout, schedule, ZeRO stage, warm-up share, clipping and export as they
    # are; smaller sizes and steps, and a learning rate for a random model: the recipe's
    # 2e-5 is sized for pretrained weights over 1000 steps and moves a random model's loss
    # by 0.01 nats in 30 steps (measured), inside the batch-to-batch spread.
    proc = _cli(["train", str(RECIPE), f"--model.hf_checkpoint={hf_model}", f"--data.path={data}",
                 f"--run.dir={run}", f"--train.steps={STEPS}", f"--train.seq_len={SEQ}",
                 "--train.global_batch=16", "--train.warmup_steps=1", "--train.lr=3e-3",
                 "--train.log_interval=100", "--eval.interval=6", "--eval.batches=1"], timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ran = json.loads((run / "config.json").read_text())
    assert (ran["parallel"]["dp"], ran["parallel"]["zero"], ran["launch"]["nproc"]) == (8, 2, 8)

    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    losses = [r["loss"] for r in records]
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    # Not chance: a fixed random model scores every batch within a few hundredths of
    # ln(301) = 5.71 nats (its logits are near zero; at lr 2e-5, where the weights hardly
    # move, the first steps logged 5.709 to 5.723). A drop of 0.5 nats is 20x that spread.
    assert first - last > 0.5, losses
    val = [r["val_loss"] for r in records if "val_loss" in r]  # the same held-out sequences
    assert len(val) == 2 and val[1] < val[0], val

    # The folder transformers loads holds exactly the last checkpoint's weights.
    out = run / "hf"
    tuned = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    start = transformers.AutoModelForCausalLM.from_pretrained(hf_model).eval()
    assert tuned.config.vocab_size == MODEL_VOCAB and tuned.config.num_key_value_heads == 2
    with CheckpointReader(find_checkpoint(run / "checkpoints")) as reader:
        assert reader.step == STEPS
        params = dict(tuned.named_parameters())
        assert sorted("model/" + name_from_hf(k) for k in params) == sorted(reader.names("model/"))
        for name, p in params.items():
            assert torch.equal(p.detach(), reader.read("model/" + name_from_hf(name))), name
    for f in out.glob("*.safetensors"):  # and the file itself, not only what transformers kept
        with safe_open(str(f), "pt") as st:
            assert all(torch.equal(st.get_tensor(k), params[k].detach()) for k in st.keys())

    # It trained: on the same held-out windows the tuned model's loss is lower than the
    # starting model's (no sampling noise in this comparison: the same tokens for both).
    val_tokens = torch.from_numpy(open_dataset(data).split("val")[0:8 * SEQ + 1].astype("int64"))
    windows = torch.stack([val_tokens[i * SEQ:(i + 1) * SEQ + 1] for i in range(8)])  # inputs + next
    before, after = _causal_lm_loss(start, windows), _causal_lm_loss(tuned, windows)
    assert abs(before - math.log(MODEL_VOCAB)) < 0.05, before  # near uniform, as said above
    assert after < before - 0.3, (before, after)
    # The source's tokenizer went along and is the one the data was prepared with.
    tok = transformers.AutoTokenizer.from_pretrained(out)
    text = "def main():\n    return 0\n"
    assert tok(text)["input_ids"] == transformers.AutoTokenizer.from_pretrained(hf_model)(text)["input_ids"]


def test_finetune_recipe_names_what_it_needs(hf_model, tmp_path, capsys):
    """Without the model folder or the data, one line (status 2) says which key to set."""
    assert cli_main(["train", str(RECIPE)]) == 2
    line = capsys.readouterr().err.strip()
    assert "\n" not in line and "set model.hf_checkpoint (--model.hf_checkpoint=DIR" in line
    assert cli_main(["train", str(RECIPE), f"--model.hf_checkpoint={tmp_path / 'nope'}"]) == 2
    assert "is not a folder" in capsys.readouterr().err
    assert cli_main(["train", str(RECIPE), f"--model.hf_checkpoint={hf_model}"]) == 2
    line = capsys.readouterr().err.strip()
    assert "\n" not in line and "data.source 'prepared' needs data.path" in line
    assert f"--tokenizer {hf_model}" in line  # the prepare-data command to run, with this model


def _tokenizer_copy(src: Path, dst: Path, swap: bool) -> Path:
    """``src``'s tokenizer re-serialised into ``dst``; with ``swap``, two ordinary tokens
    trade ids (the same size and merges, so only the id check can tell)."""
    spec = json.loads((src / "tokenizer.json").read_text())
    if swap:
        vocab = spec["model"]["vocab"]
        a, b = (t for t, i in vocab.items() if i in (100, 101))
        vocab[a], vocab[b] = vocab[b], vocab[a]
    dst.mkdir()
    (dst / "tokenizer.json").write_text(json.dumps(spec, indent=1))
    (dst / "tokenizer_config.json").write_text((src / "tokenizer_config.json").read_text())
    return dst


def test_finetune_data_must_use_the_models_token_ids(hf_model, tmp_path, capsys):
    """Data tokenized with another tokenizer of the same size passes the vocabulary check
    and would train on ids that mean other tokens: it is refused before any worker starts.
    A byte-different copy of the model's own tokenizer (same ids) is accepted."""
    from parallel3d.data.prepare import prepare_data
    from parallel3d.data.tokenizer import check_same_tokenizer

    (tmp_path / "in.txt").write_text("def f(x):\n    return x + 1\n" * 200)
    other = _tokenizer_copy(hf_model, tmp_path / "other", swap=True)
    prepare_data([str(tmp_path / "in.txt")], other, tmp_path / "data", workers=1, progress=False)
    assert cli_main(["train", str(RECIPE), f"--model.hf_checkpoint={hf_model}",
                     f"--data.path={tmp_path / 'data'}", "--train.seq_len=32",
                     f"--run.dir={tmp_path / 'run'}"]) == 2
    line = capsys.readouterr().err.strip()
    assert "\n" not in line and "was tokenized with another tokenizer than model.hf_checkpoint" in line
    assert "2 of its 300 tokens have another id" in line and f"--tokenizer {hf_model}" in line
    assert not (tmp_path / "run").exists()  # no worker started
    same = _tokenizer_copy(hf_model, tmp_path / "same", swap=False)
    prepare_data([str(tmp_path / "in.txt")], same, tmp_path / "data_same", workers=1, progress=False)
    data_same = open_dataset(tmp_path / "data_same")
    model_sha = hashlib.sha256((hf_model / "tokenizer.json").read_bytes()).hexdigest()
    assert data_same.index["tokenizer"]["sha256"] != model_sha  # the comparison of ids ran
    check_same_tokenizer(data_same, hf_model)


def test_finetune_recipe_fits_an_h100_for_llama31_8b(tmp_path):
    """The dry run the recipe's header recommends, on the model its layout is sized for:
    the planner's per-GPU estimate (bf16, as on the recipe's GPU node) fits 80 GB."""
    cfg = load_config(RECIPE, [f"--model.hf_checkpoint={write_llama31_8b_config(tmp_path / 'm')}",
                               f"--data.path={tmp_path / 'data'}", "--launch.backend=nccl"])
    lines = []
    found = dry_run(cfg, 8, out=lines.append)
    assert lines[0].startswith("dry run: 8 ranks (1 node x 8), model 8.030B parameters")
    worst = max(s.peak for s in found["stages"])
    assert worst * (1 + FRAGMENTATION) <= usable_bytes(gpu_named("h100-80g"))


def test_finetune_recipe_comment_quotes_what_its_planner_command_prints(tmp_path, capsys):
    """The recipe's comment names a `parallel3d plan ...` command and quotes the memory,
    step time and MFU of the recipe's layout: run that command and read its row. A
    consistency check of the comment, not of the figures: whether the planner's memory is
    right is for a measurement to say (benchmarks/bench_planner_memory.py)."""
    text = RECIPE.read_text()
    comment = " ".join(line.lstrip("#").strip() for line in text.splitlines() if line.startswith("#"))
    command = re.search(r"`parallel3d plan ([^`]+)`", comment)
    quoted = re.search(r"predicted at ([\d.]+) GiB per GPU \([^)]*\), ([\d.]+) s/step, MFU (\d+)%", comment)
    assert command and quoted, "the recipe's comment no longer names a plan command and its figures"
    assert cli_main(["plan", *command.group(1).split(), "--top", "1000000"]) == 0
    printed = capsys.readouterr().out
    cfg = load_config(RECIPE, [f"--model.hf_checkpoint={write_llama31_8b_config(tmp_path / 'm')}"])
    layout = Layout.from_config(cfg).describe()
    row = re.search(rf"^\s*\d+\s+{re.escape(layout)}\s+([\d.]+)G\s+([\d.]+)\s+[\d,]+\s+([\d.]+)%",
                    printed, re.MULTILINE)
    assert row, f"the planner printed no row for the recipe's layout {layout}"
    gib, step_s, mfu = row.groups()
    assert quoted.group(1) == gib, f"the comment says {quoted.group(1)} GiB, the planner {gib}G"
    assert float(quoted.group(2)) == round(float(step_s), 2), (quoted.group(2), step_s)
    assert int(quoted.group(3)) == round(float(mfu)), (quoted.group(3), mfu)
