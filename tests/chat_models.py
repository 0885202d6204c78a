"""Chat fine-tuning tests' model side: a random Hugging Face Llama with the ChatML tokenizer
of ``chat_inputs`` (the base the recipes train), and the greedy answer a trained model
gives through its chat template (what the recipes' tests compare with the trained answer)."""

from __future__ import annotations

from pathlib import Path

import torch

from chat_inputs import make_chat_tokenizer

END = "<|im_end|>"  # ChatML's end of turn: generation stops there


def save_chat_llama(folder: Path, head_scale: float = 1.0) -> Path:
    """A random Llama (2 layers of dim 64, seed 3) saved by transformers into ``folder``
    (created if missing), with a ChatML tokenizer beside it; ``head_scale`` multiplies the
    output head's weight."""
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    make_chat_tokenizer(folder, "chatml")
    cfg = transformers.LlamaConfig(vocab_size=608, hidden_size=64, intermediate_size=160,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=256, tie_word_embeddings=False)
    torch.manual_seed(3)
    model = transformers.LlamaForCausalLM(cfg)
    if head_scale != 1.0:
        with torch.no_grad():
            model.lm_head.weight.mul_(head_scale)
    model.save_pretrained(folder)
    return folder


def greedy_answer(model, tok, question: str, max_new_tokens: int = 24) -> str:
    """``model``'s greedy continuation of one user turn (the chat template with its
    generation prompt), decoded, up to and including :data:`END`."""
    end = tok.convert_tokens_to_ids(END)
    prompt = tok.apply_chat_template([{"role": "user", "content": question}], tokenize=True,
                                     add_generation_prompt=True, return_dict=False)
    ids = torch.tensor([list(prompt)])
    with torch.no_grad():
        got = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=end, pad_token_id=end)
    return tok.decode(got[0, ids.shape[1]:])
