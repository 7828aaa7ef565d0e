"""Text in and out of the server: prompts to token ids, and each request's new tokens to text
a piece at a time, never cutting a character (a byte-level tokenizer's token can hold part of
one), with stop strings found in the text.

Without a tokenizer (a checkpoint directory with none) prompts are token ids and each token's
text is ``" <id>"``."""

from __future__ import annotations

from typing import Optional, Sequence

__all__ = ["TextStream", "encode", "chat_prompt"]

# prompt tokens decoded with the first new ones, so the new text starts as it would mid-text
# (a leading space, a merged piece), as vLLM's incremental detokenizer does
CONTEXT_TOKENS = 5
INCOMPLETE = "\ufffd"  # what decoding gives for a character cut between tokens


def encode(tokenizer, prompt) -> list:
    """Token ids of a prompt (text, or ids already)."""
    if not isinstance(prompt, str):
        return list(prompt)
    if tokenizer is None:
        try:
            return [int(t) for t in prompt.split()]
        except ValueError:
            raise ValueError(
                "this model has no tokenizer: give the prompt as token ids (a list of "
                "integers, or a string of integers separated by spaces)"
            ) from None
    return list(tokenizer(prompt)["input_ids"])


def chat_prompt(tokenizer, messages: list) -> list:
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "this model has no chat template (tokenizer_config.json's chat_template): use "
            "/v1/completions"
        )
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):  # a BatchEncoding in newer transformers
        ids = ids["input_ids"]
    return list(ids)


class TextStream:
    """The text of one request's new tokens, a piece at a time. ``stops``: strings that end it
    (the text stops before the first; while streaming, the last ``len(longest) - 1``
    characters are held back until they cannot begin one)."""

    def __init__(self, tokenizer, prompt: Sequence[int], stops: Sequence[str] = ()):
        self.tokenizer, self.stops = tokenizer, tuple(stops)
        self.tokens = list(prompt[-CONTEXT_TOKENS:]) if tokenizer is not None else []
        self.prefix, self.read = 0, len(self.tokens)
        self.text = ""  # the whole new text so far (before any stop string)
        self.sent = 0  # characters of it handed out
        self.stopped = False

    def _decode(self, tokens) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def add(self, token: int) -> None:
        if self.stopped:
            return
        if self.tokenizer is None:
            self.text += f" {token}"
        else:
            self.tokens.append(token)
            before = self._decode(self.tokens[self.prefix : self.read])
            after = self._decode(self.tokens[self.prefix :])
            if len(after) > len(before) and not after.endswith(INCOMPLETE):
                self.text += after[len(before) :]
                self.prefix, self.read = self.read, len(self.tokens)
        self._find_stop()

    def finish(self) -> None:
        """The end: whatever was held back for a character still incomplete."""
        if self.tokenizer is not None and not self.stopped and self.read < len(self.tokens):
            before = self._decode(self.tokens[self.prefix : self.read])
            self.text += self._decode(self.tokens[self.prefix :])[len(before) :]
            self.read = len(self.tokens)
            self._find_stop()

    def _find_stop(self) -> None:
        hits = [i for i in (self.text.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.text, self.stopped = self.text[: min(hits)], True

    def take(self, final: bool = False) -> Optional[str]:
        """The text not handed out yet that may go now (None: nothing)."""
        hold = 0 if final or self.stopped else max((len(s) - 1 for s in self.stops), default=0)
        end = max(self.sent, len(self.text) - hold)
        piece, self.sent = self.text[self.sent : end], end
        return piece or None
