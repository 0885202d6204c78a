"""Chat data for ``prepare-data --format chat``: conversations rendered with the model's own
chat template, and which tokens are trained on.

Input: JSON lines, each ``{"messages": [{"role": ..., "content": ...}, ...]}`` (roles
system, user, assistant; any number of turns) or ``{"prompt": ..., "response": ...}``
(optionally ``"system"``), which is the two-message conversation.

Tokens: ``tokenizer.apply_chat_template(messages, tokenize=True)`` of transformers, with
the template of the tokenizer folder (``tokenizer_config.json``'s ``chat_template`` or
``chat_template.jinja``): exactly the ids the model sees at inference, BOS and end-of-turn
tokens as the template and the tokenizer put them.

Mask (1 = a target trained on): the assistant turns, each from its first content token
through its end-of-turn token. Templates rarely mark the assistant's text (a ``{%
generation %}`` tag), so each turn's span is recovered by rendering prefixes of the
conversation:

    A_i = ids(messages[:i], add_generation_prompt=True)    everything before turn i's content
    B_i = ids(messages[:i+1])                              ... through the end of turn i

The span of assistant turn i is ``[len(A_i), len(B_i))`` in the whole conversation's ids
F, provided A_i is a prefix of B_i and B_i a prefix of F (the rendering of a prefix is the
start of the rendering of the whole, token for token). The span ends at its last special
token (``<|eot_id|>``, ``<|im_end|>``, ``</s>``: the token that ends generation); what a
template writes after it (ChatML's newline) is not trained on. A conversation for which
any check fails (a template that renders earlier turns differently from the last one, a
BPE merge across the boundary) is dropped and counted, never trained on whole.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from parallel3d.errors import UserError

ROLES = ("system", "user", "assistant")
CHAT_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")

# Why a conversation was dropped (the keys of the summary's counts).
NO_ASSISTANT = "no assistant turn"
ASSISTANT_FIRST = "an assistant turn before any other"
PREFIX_FAILS = "a prefix of it fails to render"
NOT_A_PREFIX = "a prefix does not render as the start of the whole"


def _message(m, k: int, where: str) -> dict:
    if not isinstance(m, dict):
        raise UserError(f"{where}: message {k} is {type(m).__name__}, not an object with role and content")
    role = m.get("role")
    if role is None:
        raise UserError(f"{where}: message {k} has no 'role' (system, user or assistant)")
    if role not in ROLES:
        raise UserError(f"{where}: message {k} has role {role!r}: use system, user or assistant")
    content = m.get("content")
    if not isinstance(content, str):
        raise UserError(f"{where}: message {k} ({role}) has no string 'content'")
    return {"role": role, "content": content}


def conversation_of(obj, where: str) -> list[dict]:
    """The messages of one JSON line (``where`` = "file:line" for errors)."""
    if not isinstance(obj, dict):
        raise UserError(f"{where}: expected a JSON object with 'messages' (or 'prompt' and "
                        f"'response'), got {type(obj).__name__}")
    if "messages" in obj:
        messages = obj["messages"]
        if not isinstance(messages, list):
            raise UserError(f"{where}: 'messages' is {type(messages).__name__}, not a list of "
                            "{role, content} objects")
        if not messages:
            raise UserError(f"{where}: 'messages' is empty")
        return [_message(m, k, where) for k, m in enumerate(messages)]
    if "prompt" in obj or "response" in obj:
        out = []
        for key, role in (("system", "system"), ("prompt", "user"), ("response", "assistant")):
            if key not in obj and key == "system":
                continue
            if not isinstance(obj.get(key), str):
                raise UserError(f"{where}: '{key}' is {type(obj.get(key)).__name__}, not a string")
            out.append({"role": role, "content": obj[key]})
        return out
    keys = ", ".join(obj) or "none"
    raise UserError(f"{where}: no 'messages' list and no 'prompt'/'response' strings (keys: {keys})")


def has_chat_template(folder: Path) -> bool:
    """Whether the tokenizer folder holds a chat template (in tokenizer_config.json or its
    own file), read without transformers."""
    if any((folder / name).is_file() for name in CHAT_TEMPLATE_FILES):
        return True
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return isinstance(config, dict) and bool(config.get("chat_template"))


class ChatRenderer:
    """A tokenizer folder's chat template, rendering conversations to (ids, mask)."""

    def __init__(self, folder: str | Path):
        from transformers import AutoTokenizer

        folder = Path(folder)
        self.tok = AutoTokenizer.from_pretrained(str(folder))  # local files; no remote code
        if not self.tok.chat_template:
            raise UserError(f"the tokenizer in '{folder}' has no chat template "
                            f"({folder / 'tokenizer_config.json'} has no chat_template): "
                            "--format chat needs the model's own; use --format text for plain text")
        # The tokens that end a turn are special added tokens (<|eot_id|>, <|im_end|>, </s>).
        self.special = {i for i, t in self.tok.added_tokens_decoder.items() if t.special}

    def ids(self, messages: list[dict], generation_prompt: bool = False) -> list[int]:
        out = self.tok.apply_chat_template(messages, tokenize=True, return_dict=False,
                                           add_generation_prompt=generation_prompt)
        return list(out["input_ids"] if isinstance(out, dict) else out)

    def render(self, messages: list[dict], where: str) -> tuple[list[int], np.ndarray] | str:
        """(ids, mask) of one conversation, or why it is dropped. A template that fails
        on the whole conversation is bad input (UserError naming ``where``)."""
        assistant = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        if not assistant:
            return NO_ASSISTANT
        if assistant[0] == 0:
            return ASSISTANT_FIRST
        try:
            full = self.ids(messages)
        except Exception as e:  # noqa: BLE001 - jinja's and the template's own errors
            raise UserError(f"{where}: the chat template fails to render this conversation: "
                            f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
        mask = np.zeros(len(full), dtype=np.uint8)
        for i in assistant:
            try:
                before = self.ids(messages[:i], generation_prompt=True)
                through = self.ids(messages[:i + 1])
            except Exception:  # noqa: BLE001
                return PREFIX_FAILS
            a, b = len(before), len(through)
            if not (a < b <= len(full) and through[:a] == before and full[:b] == through):
                return NOT_A_PREFIX
            ends = [k for k in range(a, b) if full[k] in self.special]
            mask[a: ends[-1] + 1 if ends else b] = 1
        return full, mask


def read_conversations(path: str, first: int, lines: list[bytes]):
    """(``file:line``, messages) of each non-blank JSON line."""
    for n, line in enumerate(lines, first):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            obj = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise UserError(f"{where}: not a JSON line ({e})") from None
        yield where, conversation_of(obj, where)


class _Worker:
    renderer: ChatRenderer | None = None


def init_chat_worker(tokenizer_dir: str) -> None:
    _Worker.renderer = ChatRenderer(tokenizer_dir)


def encode_chat_task(task: tuple):
    """One unit of JSON lines: (ids, tokens per conversation, UTF-8 bytes of the kept
    conversations' text, bytes on disk, mask per token, {reason: dropped})."""
    _, (path, first, lines, _key), disk_bytes = task
    renderer = _Worker.renderer
    ids, masks, lengths, dropped, text_bytes = [], [], [], {}, 0
    for where, messages in read_conversations(path, first, lines):
        got = renderer.render(messages, where)
        if isinstance(got, str):
            dropped[got] = dropped.get(got, 0) + 1
            continue
        tokens, mask = got
        mask[0] = 0  # a document's first token is never a target
        ids.append(np.asarray(tokens, dtype=np.int64))
        masks.append(mask)
        lengths.append(len(tokens))
        text_bytes += sum(len(m["content"].encode("utf-8")) for m in messages)
    flat = np.concatenate(ids) if ids else np.empty(0, dtype=np.int64)
    mask = np.concatenate(masks) if masks else np.empty(0, dtype=np.uint8)
    return flat, np.asarray(lengths, dtype=np.int64), text_bytes, disk_bytes, mask, dropped
