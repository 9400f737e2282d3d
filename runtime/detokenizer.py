"""A growing sequence's text, decoded a few tokens at a time; one token's text and bytes."""

import functools
import re


PROMPT_CONTEXT = 5  # the prompt's last tokens a generated text is decoded after
BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte fallback: one byte of a character


class IncrementalDetokenizer:
    """The text a growing list of generated token ids adds after the prompt, at a cost per call
    that does not grow with it.

    A token's text can depend on its neighbours (a leading space a tokenizer drops at the start
    of a text, a character whose bytes span several tokens), so the ids are decoded after the
    prompt's last ``PROMPT_CONTEXT`` tokens, and each call decodes a short window twice: from
    ``prefix_offset`` to ``read_offset`` (text already given out) and from ``prefix_offset`` to the
    end; what the second adds is the new text. Of new text that ends in an incomplete character
    (U+FFFD), the characters before it are given out (a stop string may end there) and the window
    waits for the tokens that complete the last one.
    """

    def __init__(self, tokenizer, prompt_token_ids: list[int] = ()):
        self.tokenizer = tokenizer
        self.text = ""
        # Offsets count the context's ids, then the generated ones.
        self.context = list(prompt_token_ids[max(len(prompt_token_ids) - PROMPT_CONTEXT, 0):])
        self.prefix_offset = 0
        self.read_offset = len(self.context)
        self.given = 0  # characters of the window's new text given out while it was incomplete

    def update(self, token_ids: list[int]) -> str:
        """The text of the generated ``token_ids``, which extend the ids of the previous call."""
        end = len(self.context) + len(token_ids)
        # A run of byte-fallback tokens decodes as a whole (each byte U+FFFD if the run is no valid
        # UTF-8): its text is settled only once a token of another kind ends it.
        if end > self.read_offset and not (token_ids and self._byte_piece(token_ids[-1])):
            known = self._decode(self._window(token_ids, self.read_offset))
            extended = self._decode(self._window(token_ids, end))
            new = extended[len(known):]
            complete = new.rstrip("\ufffd")
            self.text += complete[self.given:]
            self.given = max(self.given, len(complete))
            if new and not new.endswith("\ufffd"):
                self.prefix_offset, self.read_offset, self.given = self.read_offset, end, 0
        return self.text

    def _window(self, token_ids: list[int], end: int) -> list[int]:
        context = len(self.context)
        return self.context[self.prefix_offset:end] + token_ids[max(self.prefix_offset - context, 0):end - context]

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def _byte_piece(self, token_id: int) -> bool:
        return BYTE_PIECE.fullmatch(self.tokenizer.convert_ids_to_tokens(token_id) or "") is not None


def text_after(tokenizer, prompt_token_ids: list[int], token_ids: list[int]) -> str:
    """The text generated ``token_ids`` add after the prompt's: decoded alone, a first token may
    lose its leading space (SentencePiece's decoders drop it at the start of a text)."""
    context = list(prompt_token_ids[max(len(prompt_token_ids) - PROMPT_CONTEXT, 0):])
    before = tokenizer.decode(context, skip_special_tokens=True)
    text = tokenizer.decode(context + token_ids, skip_special_tokens=True)
    return text[len(before):] if text.startswith(before) else tokenizer.decode(token_ids, skip_special_tokens=True)


def token_text(tokenizer, token_id: int) -> tuple[str, bytes]:
    """One token's text and its bytes, which may be part of a character's UTF-8 (the text then
    shows U+FFFD). The text is what the token adds after another (a SentencePiece decoder drops
    the space a text begins with). A partial character's bytes are read off its piece: a
    byte-level BPE piece has one character per byte, a byte-fallback piece is ``<0xNN>``."""
    alone, twice = tokenizer.decode([token_id]), tokenizer.decode([token_id, token_id])
    text = twice[len(alone):] if twice.startswith(alone) else alone
    if "\ufffd" not in text:
        return text, text.encode()
    piece = tokenizer.convert_ids_to_tokens(token_id)
    if byte := BYTE_PIECE.fullmatch(piece):
        return text, bytes([int(byte[1], 16)])
    byte_of = _byte_level_bytes()
    if all(char in byte_of for char in piece):
        return text, bytes(byte_of[char] for char in piece)
    return text, text.encode()


@functools.cache
def _byte_level_bytes() -> dict[str, int]:
    """The byte each character of byte-level BPE's alphabet stands for."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {char: byte for byte, char in bytes_to_unicode().items()}
