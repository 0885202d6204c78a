"""``prepare-data --format chat``: the ids are exactly transformers' apply_chat_template, the
mask covers exactly the assistant turns and their end-of-turn tokens (checked against
transformers' own assistant mask of the same template with {% generation %} tags), for
a Llama-3-style, a ChatML and a Mistral [INST] template; unrecoverable conversations are
dropped and counted; bad input is one line naming the file and line (issue 19, 2 and 6)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from parallel3d.cli import main as cli_main
from parallel3d.data.chat import ChatRenderer
from parallel3d.data.format import open_dataset, verify_checksums
from parallel3d.data.prepare import prepare_data

from chat_inputs import MULTI, SINGLE, TEMPLATES, make_chat_tokenizer, write_jsonl

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """name -> (folder without generation tags, twin folder with them)."""
    root = tmp_path_factory.mktemp("chat_tok")
    return {name: (make_chat_tokenizer(root / name, name),
                   make_chat_tokenizer(root / f"{name}_tagged", name, tagged=True))
            for name in TEMPLATES}


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_ids_are_apply_chat_template_and_mask_is_the_assistant_turns(tokenizers, name, tmp_path):
    plain, tagged = tokenizers[name]
    tok = transformers.AutoTokenizer.from_pretrained(str(plain))
    reference = transformers.AutoTokenizer.from_pretrained(str(tagged))
    eot = TEMPLATES[name][3]
    expected_ids, expected_mask = [], []
    for conv in (SINGLE, MULTI):
        ids, mask = ChatRenderer(plain).render(conv, "test")
        assert ids == list(tok.apply_chat_template(conv, tokenize=True, return_dict=False))
        ref = reference.apply_chat_template(conv, tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True)
        assert ids == ref["input_ids"]  # the tags change no token
        assert mask.tolist() == ref["assistant_masks"]
        # and read back as text: each answer followed by its end-of-turn token, nothing else
        answers = [m["content"] for m in conv if m["role"] == "assistant"]
        assert tok.decode([t for t, m in zip(ids, mask) if m]) == "".join(a + eot for a in answers)
        expected_ids += ids
        expected_mask += mask.tolist()
    # through prepare-data: the stored tokens and mask are those, conversation by conversation
    write_jsonl(tmp_path / "in.jsonl", [{"messages": SINGLE}, {"messages": MULTI}])
    report = prepare_data([str(tmp_path / "in.jsonl")], plain, tmp_path / "data", workers=1,
                          progress=False, format="chat")
    ds = open_dataset(tmp_path / "data")
    verify_checksums(ds)
    assert ds.has_loss_mask and ds.has_documents
    assert ds.split("train")[:].tolist() == expected_ids
    assert ds.loss_mask("train")[:].tolist() == expected_mask
    assert ds.document_starts("train").tolist() == [0, len(expected_ids) - len(ids)]
    assert report.supervised == sum(expected_mask) and not report.dropped


# A ChatML variant that shows only the last answer in full, as templates that strip earlier
# turns' reasoning do: earlier answers render differently in a longer conversation.
HIDING = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' "
          "and not loop.last %}(earlier answer){% else %}{{ m['content'] }}{% endif %}<|im_end|>"
          "{{ '\\n' }}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_unrecoverable_conversations_are_dropped_and_counted(tokenizers, tmp_path):
    tok = tmp_path / "tok"
    tok.mkdir()
    plain = tokenizers["chatml"][0]
    (tok / "tokenizer.json").write_bytes((plain / "tokenizer.json").read_bytes())
    config = json.loads((plain / "tokenizer_config.json").read_text())
    (tok / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": HIDING}))
    rows = [{"messages": SINGLE}, {"messages": MULTI}, {"messages": MULTI[:2]},
            {"prompt": "a", "response": "b"}]
    write_jsonl(tmp_path / "in.jsonl", rows)
    report = prepare_data([str(tmp_path / "in.jsonl")], tok, tmp_path / "data", workers=1,
                          progress=False, format="chat")
    assert report.docs == {"train": 2, "val": 0}  # the single-turn ones
    assert report.dropped == {"a prefix does not render as the start of the whole": 1,
                              "no assistant turn": 1}
    assert "dropped 2 conversations (1 a prefix does not render" in report.summary()


def _one_line_error(capsys, args) -> str:
    assert cli_main(args) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err, err
    return err


@pytest.mark.parametrize("row,message", [
    ({"messages": [{"content": "hi"}]}, "message 0 has no 'role'"),
    ({"messages": {"role": "user", "content": "hi"}}, "'messages' is dict, not a list"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"},
                   {"role": "assistant", "content": "c"}]},
     "the chat template fails to render this conversation: TemplateError: Conversation roles must alternate"),
    ({"messages": [{"role": "robot", "content": "a"}]}, "message 0 has role 'robot'"),
    ({"prompt": "a", "response": 3}, "'response' is int, not a string"),
    ({"text": "plain"}, "no 'messages' list and no 'prompt'/'response'"),
    ("[1, 2", "not a JSON line"),
])
def test_bad_chat_input_is_one_line_naming_file_and_line(tokenizers, tmp_path, capsys, row, message):
    good = {"messages": SINGLE[1:]}
    path = write_jsonl(tmp_path / "chats.jsonl", [good, good, row])
    err = _one_line_error(capsys, ["prepare-data", str(path), "--tokenizer", str(tokenizers["mistral"][0]),
                                   "--out", str(tmp_path / "out"), "--format", "chat", "--workers", "1",
                                   "--quiet"])
    assert f"{path}:3: " in err and message in err, err
    assert not (tmp_path / "out" / "index.json").exists()


def test_chat_needs_a_template_and_json_lines(tmp_path, capsys):
    from data_inputs import make_tokenizer

    tok = make_tokenizer(tmp_path / "tok")  # no chat_template
    path = write_jsonl(tmp_path / "chats.jsonl", [{"messages": SINGLE}])
    args = ["--tokenizer", str(tok), "--out", str(tmp_path / "out"), "--format", "chat", "--quiet"]
    err = _one_line_error(capsys, ["prepare-data", str(path), *args])
    assert f"{tok / 'tokenizer_config.json'} has no chat_template" in err
    (tmp_path / "doc.txt").write_text("plain text")
    err = _one_line_error(capsys, ["prepare-data", str(tmp_path / "doc.txt"), *args])
    assert f"'{tmp_path / 'doc.txt'}' is not" in err and "--format chat reads JSON lines" in err


def test_a_tokenizer_model_only_folder_is_converted_by_transformers(tokenizers, tmp_path):
    """A SentencePiece tokenizer.model without tokenizer.json: prepare-data converts it
    through transformers, and the ids are what transformers' tokenizer gives."""
    spm = pytest.importorskip("sentencepiece")
    text = "\n".join(f"the quick brown fox number {i} jumps over the lazy dog" for i in range(200))
    (tmp_path / "corpus.txt").write_text(text)
    spm.SentencePieceTrainer.train(input=str(tmp_path / "corpus.txt"), model_prefix=str(tmp_path / "sp"),
                                   vocab_size=330, model_type="bpe", byte_fallback=True,
                                   character_coverage=1.0, minloglevel=2)
    folder = tmp_path / "model"
    folder.mkdir()
    (tmp_path / "sp.model").rename(folder / "tokenizer.model")
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "chat_template": TEMPLATES["mistral"][0]()}))
    docs = ["the lazy fox", "number 7 jumps"]
    write_jsonl(tmp_path / "in" / "docs.jsonl", [{"text": d} for d in docs])
    prepare_data([str(tmp_path / "in")], folder, tmp_path / "data", workers=1, progress=False)
    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    eos = tok.convert_tokens_to_ids("</s>")
    want = [i for d in docs for i in tok(d, add_special_tokens=False)["input_ids"] + [eos]]
    ds = open_dataset(tmp_path / "data")
    assert ds.split("train")[:].tolist() == want
    assert (tmp_path / "data" / "tokenizer" / "tokenizer.json").is_file()  # the conversion, kept
    write_jsonl(tmp_path / "chat" / "c.jsonl", [{"messages": SINGLE}])
    prepare_data([str(tmp_path / "chat")], folder, tmp_path / "chat_data", workers=1, progress=False,
                 format="chat")
    got = open_dataset(tmp_path / "chat_data").split("train")[:].tolist()
    assert got == list(tok.apply_chat_template(SINGLE, tokenize=True, return_dict=False))
    assert np.asarray(open_dataset(tmp_path / "chat_data").loss_mask("train")[:]).sum() > 0
