"""The per-token side of `logprobs`: each token's text (from incremental detokenization) and bytes.

Decoding tokens one by one is wrong for byte-level vocabularies: a token that is part of a
multi-byte UTF-8 character decodes to U+FFFD alone, so the tokens no longer join to the text and
their offsets run past it. Here a token's text is what incremental detokenization adds when the
token arrives (`jpa.engine.detokenizer.IncrementalDetokenizer`, the engine's own scheme): "" for
the first bytes of a character, the whole character for the token that completes it. Hence
"".join(tokens) == text, and text_offset indexes the text. A token's bytes are its real bytes
(the vocabulary's byte-level piece), which may be an incomplete UTF-8 sequence; concatenated, they
are the UTF-8 text.

`ChoiceTokens` does this for one choice across a stream: a token is released once the text it
contributes has been released (the engine holds text back while it may start a stop string), so
text_offset continues across chunks, and at the end its text is clipped to the final text (a stop
string cut inside a token).
"""

import functools
import re

from jpa.engine.detokenizer import IncrementalDetokenizer


@functools.lru_cache(maxsize=1)
def _byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet (each byte spelled as one printable character), inverted."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class TokenBytes:
    """Token id -> its bytes, for any tokenizer with encode/decode (cached).

    Byte-level BPE vocabularies (GPT-2, Llama-3, Qwen, SmolLM2: `id_to_token` spelled in GPT-2's
    byte alphabet) map each piece back to its bytes; SentencePiece byte-fallback pieces ("<0xE2>")
    are that byte, other SentencePiece pieces their text with "▁" as a space. A tokenizer whose ids
    0..255 are the bytes themselves (jpa's ByteTokenizer: checked by encoding a non-ASCII string)
    gives the byte. Each piece is checked against the tokenizer's own decode of the token; where it
    disagrees (special tokens, which the text skips), the token's bytes are its decoded text's.
    With skip_special_tokens=False (the request keeps special tokens in its text) a special
    token's bytes are its spelled-out text's.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tok = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.id_to_token = getattr(tokenizer, "id_to_token", None)
        probe = "aé€"
        try:
            self.raw_bytes = self.id_to_token is None and list(tokenizer.encode(probe)) == list(probe.encode("utf-8"))
        except Exception:
            self.raw_bytes = False
        self._cache: dict[int, bytes] = {}

    def _decoded(self, t: int) -> str:
        return self.tok.decode([t], skip_special_tokens=self.skip_special_tokens)

    def _compute(self, t: int) -> bytes:
        if self.raw_bytes and t < 256:
            return bytes([t])
        piece = self.id_to_token(t) if self.id_to_token is not None else None
        if isinstance(piece, str) and piece:
            alphabet = _byte_alphabet()
            if all(c in alphabet for c in piece):
                b = bytes(alphabet[c] for c in piece)
                if b.decode("utf-8", "replace") == self._decoded(t):
                    return b
            m = _BYTE_FALLBACK.fullmatch(piece)
            if m:
                return bytes([int(m.group(1), 16)])
            if "▁" in piece:
                text = piece.replace("▁", " ")
                if self._decoded(t) in (text, text.lstrip(" ")):
                    return text.encode("utf-8")
        return self._decoded(t).encode("utf-8")

    def __call__(self, t: int) -> bytes:
        b = self._cache.get(t)
        if b is None:
            b = self._cache[t] = self._compute(t)
        return b


def prompt_pieces(tokenizer, ids, skip_special_tokens: bool = True) -> list[str]:
    """Each prompt token's text by incremental detokenization (they join to the decoded prompt)."""
    det = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
    out = []
    for i, t in enumerate(ids):
        before = len(det.text)
        det.add([t], final=i == len(ids) - 1)
        out.append(det.text[before:])
    return out


class ChoiceTokens:
    """Per-token text, bytes and text offset of one choice's output, released with its text.

    Feed it what the engine reports (`feed`), once per output; it returns the tokens whose text
    the client has now received, as (text, bytes, logprob, text_offset) tuples.
    """

    def __init__(self, tokenizer, token_bytes: TokenBytes, *, base: int = 0):
        # No stop strings: every token's own text (special tokens as the request's text has them).
        self.det = IncrementalDetokenizer(tokenizer, skip_special_tokens=token_bytes.skip_special_tokens)
        self.token_bytes = token_bytes
        self.pending: list[list] = []   # [text, bytes, logprob] fed, not released yet
        self.made = 0                   # chars of token text made so far (released + pending)
        self.offset = 0                 # chars of token text released (text_offset of the next token - base)
        self.base = base                # text before the first token's (an echoed prompt)
        self.released_text = 0          # chars of the choice's text the client has received

    def feed(self, token_ids, logprobs, new_text: str, finished: bool) -> list[tuple]:
        """Args:
          token_ids / logprobs: this output's tokens that belong to the text (a final EOS dropped).
          new_text: the text this output adds to the choice.
          finished: the choice is done (flush everything; clip to the final text).
        """
        token_ids = list(token_ids)
        for i, (t, lp) in enumerate(zip(token_ids, logprobs)):
            before = len(self.det.text)
            self.det.add([t], final=finished and i == len(token_ids) - 1)
            piece = self.det.text[before:]
            self.pending.append([piece, self.token_bytes(t), lp])
            self.made += len(piece)
        if finished and not token_ids:
            # The last token (maybe the first bytes of a character) was followed only by EOS: flush.
            before = len(self.det.text)
            self.det.add([], final=True)
            piece = self.det.text[before:]
            if piece and self.pending:
                self.pending[-1][0] += piece
                self.made += len(piece)
        self.released_text += len(new_text)
        out = []
        while self.pending:
            text, b, lp = self.pending[0]
            # A token is settled once its text can no longer grow: it has text (the detokenizer holds
            # a token's whole text back while it ends in an incomplete character), a later token came,
            # or the choice finished. It is released once the client has all of its text.
            settled = finished or len(self.pending) > 1 or text != ""
            if not finished and not (settled and self.offset + len(text) <= self.released_text):
                break
            if finished:  # the final text may be shorter (a stop string cut): clip to it
                text = text[:max(0, self.released_text - self.offset)]
            self.pending.pop(0)
            out.append((text, b, lp, self.base + self.offset))
            self.offset += len(text)
        return out
