"""The one rule for the evaluation's prompts: a tokenizer with a chat template gets the chat form (the content as the
user turn, then the assistant header; tokenized without adding special tokens, the template has them); a tokenizer
without one (a base model, e.g. Gemma 3 270M from its GGUF file) gets the completion form: the plain text, which its
tokenizer prefixes with its own special tokens (Gemma's ``<bos>``)."""

from __future__ import annotations

CHAT_TOKENIZER_KWARGS = {"add_special_tokens": False}


def has_chat_template(tok) -> bool:
    """True when ``tok`` carries a chat template."""
    return bool(getattr(tok, "chat_template", None))


def chat_prompt(tok, content: str) -> str:
    """``content`` as the user turn of ``tok``'s chat template, with the assistant header after it."""
    return tok.apply_chat_template([{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True)
