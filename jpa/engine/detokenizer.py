"""Incremental detokenization and stop strings (host side, plain Python).

Decoding a request's whole output every round to look for stop strings costs O(n^2) over a
request. `IncrementalDetokenizer` decodes only a small window per update: the tokens of the
previous update (context, so tokenizers that merge across tokens render correctly) plus the new
ones (the prefix-offset / read-offset scheme of Hugging Face TGI and vLLM). Text is held back
while it ends in an incomplete UTF-8 sequence (U+FFFD), so the pieces concatenate to the full
decode. Special tokens are skipped (or, with skip_special_tokens=False, kept) both in the text
returned and in the stop-string search, so the two always agree.
"""


class IncrementalDetokenizer:
    """Text of one request's growing output, with stop-string detection.

    Args:
      tokenizer: has `decode(ids, skip_special_tokens=...)`.
      stop: stop strings; the text is cut before the earliest one found (after it with
        include_stop).
      include_stop: keep the stop string that ended the text (vLLM's include_stop_str_in_output).
      skip_special_tokens: leave special tokens out of the text (vLLM's default).

    Attributes:
      text: the completion text so far (after a stop: cut before the stop string).
      stopped: True once a stop string was found.
    """

    def __init__(self, tokenizer, stop: tuple[str, ...] = (), *, include_stop: bool = False,
                 skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self.stop = tuple(stop)
        self.include_stop = include_stop
        self.skip_special_tokens = skip_special_tokens
        # A stop string may be completed by later tokens: the stop search looks this far back, and
        # (unless the stop string stays in the text) its possible beginning is kept unstreamed.
        self._search = max((len(s) for s in self.stop), default=1) - 1
        self._hold = 0 if include_stop else self._search
        self._window: list[int] = []   # ids decoded as context + ids not yet turned into text
        self._read = 0                 # window[:read] is context already in self.text
        self._prefix_text = ""         # decode(window[:read])
        self.text = ""
        self._streamed = 0             # chars of text already handed out by take_delta
        self.stopped = False

    def _decode(self, ids) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _advance(self, new_ids, final: bool) -> tuple[str, str]:
        """Adds tokens to the window. Returns (delta, visible): delta is the text they complete
        ("" while the window ends in an incomplete character: held back), visible also includes
        the held-back text before that character, for the stop search. A stop string must be
        found in the round its last token arrives, even when a partial character follows it."""
        self._window.extend(new_ids)
        full = self._decode(self._window)
        if full.endswith("\ufffd") and not final:
            # Maybe the middle of a multi-byte character: wait for the next token.
            return "", full.rstrip("\ufffd")[len(self._prefix_text):]
        delta = full[len(self._prefix_text):]
        self._window = self._window[self._read:]
        self._read = len(self._window)
        self._prefix_text = self._decode(self._window)
        return delta, delta

    def _find_stop(self, new_text: str) -> tuple[int, int] | None:
        """(start, end) in self.text + new_text of the earliest stop string that ends inside new_text.

        Only the last (longest stop - 1) chars of self.text are searched with it: O(new text).
        """
        base = max(0, len(self.text) - self._search)
        window = self.text[base:] + new_text
        searched = len(self.text) - base
        cuts = [(c, c + len(s)) for s in self.stop if (c := window.find(s, max(0, searched - len(s) + 1))) >= 0]
        if not cuts:
            return None
        start, end = min(cuts)
        return base + start, base + end

    def add(self, new_ids, *, final: bool = False) -> int:
        """Feeds the next tokens (one update per engine round).

        Args:
          new_ids: token ids appended to the output since the last call.
          final: no more tokens will come (flush text held back for an incomplete character).

        Returns:
          How many of new_ids belong to the output: all of them, or, when a stop string
          completed, the tokens up to and including the one that completed it.
        """
        if self.stopped:
            return 0
        new_ids = list(new_ids)
        if not self.stop:
            self.text += self._advance(new_ids, final)[0]
            return len(new_ids)
        saved = (list(self._window), self._read, self._prefix_text)
        delta, visible = self._advance(new_ids, final)
        cut = self._find_stop(visible)
        if cut is None:
            self.text += delta
            return len(new_ids)
        # Rare (once per request): replay token by token to find the token that completed it.
        self._window, self._read, self._prefix_text = saved
        done, kept = "", len(new_ids)
        for i, t in enumerate(new_ids):
            d, vis = self._advance([t], final and i == len(new_ids) - 1)
            if self._find_stop(done + vis) is not None:
                kept = i + 1
                break
            done += d
        self.text, self.stopped = (self.text + visible)[:cut[1] if self.include_stop else cut[0]], True
        return kept

    def take_delta(self, finished: bool) -> str:
        """Text not handed out yet; while running, the last (longest stop - 1) chars wait."""
        end = len(self.text) if finished or self.stopped else max(self._streamed, len(self.text) - self._hold)
        delta, self._streamed = self.text[self._streamed:end], end
        return delta
