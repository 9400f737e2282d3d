"""A growing sequence's text, decoded a few tokens at a time."""


class IncrementalDetokenizer:
    """The text of a list of token ids that only grows, at a cost per call that does not grow with it.

    A token's text can depend on its neighbours (a leading space a tokenizer drops at the start
    of a text, a character whose bytes span several tokens), so each call decodes a short window
    twice: from ``prefix_offset`` to ``read_offset`` (text already given out) and from
    ``prefix_offset`` to the end; what the second adds is the new text. New text that ends in an
    incomplete character (U+FFFD) waits for the tokens that complete it.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.text = ""
        self.prefix_offset = 0
        self.read_offset = 0

    def update(self, token_ids: list[int]) -> str:
        """The text of ``token_ids``, which extend the ids of the previous call."""
        if len(token_ids) > self.read_offset:
            known = self._decode(token_ids[self.prefix_offset:self.read_offset])
            extended = self._decode(token_ids[self.prefix_offset:])
            if len(extended) > len(known) and not extended.endswith("\ufffd"):
                self.text += extended[len(known):]
                self.prefix_offset, self.read_offset = self.read_offset, len(token_ids)
        return self.text

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)
