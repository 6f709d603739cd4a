"""TextStream: the streaming detokenizer `generate` writes its output through."""

from __future__ import annotations

import sys


class TextStream:
    """Decodes ids as they arrive and writes only the new, complete text (a byte-level BPE token can end in the
    middle of a UTF-8 character: such a tail is held back until the next token completes it)."""

    def __init__(self, tokenizer, out=None):
        self.tok, self.out, self.ids, self.shown = tokenizer, out or sys.stdout, [], 0

    def __call__(self, rows):
        self.ids.extend(int(i) for i in rows[0])
        text = self.tok.decode(self.ids)
        end = len(text)
        while end > self.shown and text[end - 1] == "\ufffd":
            end -= 1
        if end > self.shown:
            self.out.write(text[self.shown:end])
            self.out.flush()
            self.shown = end

    def finish(self):
        text = self.tok.decode(self.ids)
        if len(text) > self.shown:
            self.out.write(text[self.shown:])
        self.out.write("\n")
        self.out.flush()
