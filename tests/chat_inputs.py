"""Test inputs for chat data: tokenizer folders with chat templates written here (a Llama-3
style, a ChatML and a Mistral [INST] one, none with a generation tag), their twins with
``{% generation %}`` tags (transformers' own assistant mask, the reference), and small
conversation files. Nothing is downloaded: the BPE is trained on this machine's stdlib."""

from __future__ import annotations

import json
from pathlib import Path

from parallel3d.data.stdlib import read_stdlib

# Llama 3's pre-tokenizer pattern: runs of newlines are one piece whatever follows them,
# so a header's "\n\n" tokenizes the same with or without the content after it.
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                  r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _turns(user: str, assistant: str) -> str:
    """The loop of a template: ``user`` renders a non-assistant message ``m``,
    ``assistant`` an assistant one."""
    return ("{% for m in messages %}{% if m['role'] == 'assistant' %}" + assistant
            + "{% else %}" + user + "{% endif %}{% endfor %}")


def _gen(body: str, tagged: bool) -> str:
    return "{% generation %}" + body + "{% endgeneration %}" if tagged else body


def llama3_template(tagged: bool = False) -> str:
    head = "<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    return ("{{ bos_token }}" + _turns(head + "{{ m['content'] }}<|eot_id|>",
                                       head + _gen("{{ m['content'] }}<|eot_id|>", tagged))
            + "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")


def chatml_template(tagged: bool = False) -> str:
    # The newline after <|im_end|> as an expression: transformers renders with
    # trim_blocks, which would drop a literal newline right after {% endgeneration %}.
    head = "<|im_start|>{{ m['role'] }}\n"
    return (_turns(head + "{{ m['content'] }}<|im_end|>{{ '\\n' }}",
                   head + _gen("{{ m['content'] }}<|im_end|>", tagged) + "{{ '\\n' }}")
            + "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def mistral_template(tagged: bool = False) -> str:
    """Mistral's [INST] format: the system prompt joins the first user turn, roles must
    alternate (the template raises otherwise), EOS closes each assistant turn."""
    return ("{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
            "{% set sys = messages[0]['content'] + '\n\n' %}{% set msgs = messages[1:] %}"
            "{% else %}{% set sys = '' %}{% set msgs = messages %}{% endif %}"
            "{% for m in msgs %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
            "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant') }}"
            "{% endif %}{% if m['role'] == 'user' %}[INST] {% if loop.first %}{{ sys }}{% endif %}"
            "{{ m['content'] }} [/INST]{% else %}" + _gen("{{ m['content'] }}{{ eos_token }}", tagged)
            + "{% endif %}{% endfor %}")


# name -> (template builder, special tokens, bos, eos)
TEMPLATES = {
    "llama3": (llama3_template, ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                                 "<|end_header_id|>", "<|eot_id|>"], "<|begin_of_text|>", "<|eot_id|>"),
    "chatml": (chatml_template, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], None, "<|im_end|>"),
    "mistral": (mistral_template, ["<unk>", "<s>", "</s>", "[INST]", "[/INST]"], "<s>", "</s>"),
}


def make_chat_tokenizer(out_dir: Path, name: str, vocab_size: int = 600, tagged: bool = False,
                        docs: list[str] | None = None) -> Path:
    """A byte-level BPE (Llama 3's pre-tokenizer pattern) saved as a Hugging Face folder
    whose tokenizer_config.json carries template ``name`` (with generation tags if
    ``tagged``)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    build, specials, bos, eos = TEMPLATES[name]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(docs or read_stdlib(200_000), trainer)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos,
              "chat_template": build(tagged)}
    if bos:
        config["bos_token"] = bos
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return out_dir


SYSTEM = "You are a terse assistant."
SINGLE = [{"role": "system", "content": SYSTEM},
          {"role": "user", "content": "What is two plus two?"},
          {"role": "assistant", "content": "Four."}]
MULTI = SINGLE + [{"role": "user", "content": "And three plus three?"},
                  {"role": "assistant", "content": "Six, since 3 + 3 = 6."},
                  {"role": "user", "content": "Thanks"},
                  {"role": "assistant", "content": "You are welcome."}]


def write_jsonl(path: Path, rows: list) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


WORDS = ("alpha beta gamma delta river stone light green quick slow house tree cloud "
         "paper seven eleven north south table window garden music").split()


def make_conversations(n: int, seed: int) -> list[dict]:
    """``n`` conversations whose assistant share varies widely: long prompts with
    one-word answers, short prompts with long answers, multi-turn ones, some with a
    system prompt, some in prompt/response form."""
    import random

    rng = random.Random(seed)

    def text(lo: int, hi: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))

    out = []
    for i in range(n):
        kind = i % 4
        if kind == 0:
            out.append({"messages": [{"role": "user", "content": text(20, 40)},
                                     {"role": "assistant", "content": text(1, 1)}]})
        elif kind == 1:
            out.append({"prompt": text(1, 3), "response": text(20, 40)})
        elif kind == 2:
            out.append({"messages": [{"role": "system", "content": text(3, 6)},
                                     {"role": "user", "content": text(2, 8)},
                                     {"role": "assistant", "content": text(2, 8)},
                                     {"role": "user", "content": text(2, 8)},
                                     {"role": "assistant", "content": text(5, 15)}]})
        else:
            out.append({"system": text(2, 4), "prompt": text(5, 10), "response": text(3, 6)})
    return out
