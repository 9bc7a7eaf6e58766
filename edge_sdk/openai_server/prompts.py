"""Chat prompts as token ids: the tokenizer's chat template, or a plain fallback for a
tokenizer without one."""

from __future__ import annotations

__all__ = ["chat_prompt_ids", "fallback_chat_text"]


def fallback_chat_text(messages: list[dict]) -> str:
    """The chat formatting used when the tokenizer has no chat template."""
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"


def chat_prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of a chat (list of ``{"role", "content"}``) ready for the assistant's
    turn: the tokenizer's chat template, else :func:`fallback_chat_text`."""
    msgs = [{"role": m["role"], "content": m["content"]} for m in messages]
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                            return_dict=False)
        return [int(i) for i in ids]
    ids = tokenizer.encode(fallback_chat_text(msgs), add_special_tokens=False)
    return [int(i) for i in ids] or [int(tokenizer.bos_token_id or 0)]
