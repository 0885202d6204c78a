"""recipes/lora_chat.toml end to end through the command line (issue 35, point 4): a random
Hugging Face Llama with a ChatML tokenizer is the base, `prepare-data --format chat` makes
the data, `train` runs the recipe (shrunk for CPU) with the base frozen and only the
adapters trained, and the PEFT folder it exports, loaded by peft onto the base with
transformers, answers the training prompts with the trained answers under greedy decoding."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from parallel3d.cli import main as cli_main
from parallel3d.data.prepare import prepare_data

from chat_inputs import write_jsonl
from chat_models import END, greedy_answer, save_chat_llama
from test_sft_recipe import CONVERSATIONS, ROOT

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

RECIPE = ROOT / "recipes" / "lora_chat.toml"


def _base_model(folder: Path) -> Path:
    # The head scaled to rows of norm ~6: under the final norm (RMS 1) a logit is at most
    # |row| x 8, and the init's rows of 0.16 cap every logit near 1, which a frozen head
    # keeps (a trained model's head is not so flat; measured: loss 5.8 after 60 steps).
    return save_chat_llama(folder, head_scale=40)


pytestmark = pytest.mark.usefixtures("one_thread")


def test_lora_recipe_learns_conversations_and_peft_answers_them(tmp_path):
    base_dir = _base_model(tmp_path / "base")
    rows = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
            for _ in range(8) for q, a in CONVERSATIONS]
    write_jsonl(tmp_path / "chats.jsonl", rows)
    data = tmp_path / "data"
    prepare_data([str(tmp_path / "chats.jsonl")], base_dir, data, format="chat", val_fraction=0.1,
                 workers=1, progress=False)
    run = tmp_path / "run"
    # The recipe's LoRA section, packing and export as they are; one process (in this one:
    # the PEFT export gathered over tp x pp is test_lora's), small windows and batches,
    # and a learning rate for adapters on a random base to memorise five answers in 60 steps.
    code = cli_main(["train", str(RECIPE), f"--model.hf_checkpoint={base_dir}", f"--data.path={data}",
                     f"--run.dir={run}", "--parallel.dp=1", "--launch.nproc=1", "--train.steps=60",
                     "--train.seq_len=64", "--train.global_batch=4", "--train.warmup_steps=5",
                     "--train.lr=1e-2", "--train.log_interval=100", "--eval.interval=0",
                     "--checkpoint.interval=0",
                     "--launch.threads_per_proc=1"])  # 2 threads on a loaded 2-core box: 10x slower
    assert code == 0
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["loss"] < 0.1 < records[0]["loss"], [r["loss"] for r in records]

    adapter = run / "adapter"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["r"] == 16 and config["base_model_name_or_path"] == str(base_dir)
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir)
    model = peft.PeftModel.from_pretrained(base, str(adapter)).eval()
    tok = transformers.AutoTokenizer.from_pretrained(adapter)  # the base's, copied along
    for i, (question, answer) in enumerate(CONVERSATIONS):
        assert greedy_answer(model, tok, question) == answer + END, question
        if i == 0:
            with model.disable_adapter():  # the base alone does not know it
                assert greedy_answer(model, tok, question) != answer + END
