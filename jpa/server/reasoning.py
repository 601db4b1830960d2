"""Reasoning parsers (`--reasoning-parser`): a chat output's `<think>...</think>` part as
`reasoning_content` (and vLLM's newer name `reasoning`), the rest as `content`.

Formats (vLLM's parser names):
- "deepseek_r1": DeepSeek-R1's templates open `<think>` in the prompt, so the output is reasoning
  up to `</think>` (a leading `<think>` is dropped); an output that never closes it is all reasoning.
- "qwen3": Qwen3 emits `<think>` itself (and with `enable_thinking: false` its template puts an
  empty think block in the prompt): an output that starts with `<think>` (after whitespace) is
  reasoning up to `</think>`; any other output is all content.

Under a constraint the grammar has the same shape (`jpa.engine.structured.Reasoning`: a free thought
up to the first `</think>`, then the constraint), so the answer this parser splits off is the
constrained part.

`split(text)` parses a whole output; `ReasoningStream` turns streamed text deltas into (reasoning
delta, content delta), holding back only what may be the start of a tag, so the deltas join to
exactly what `split` returns.
"""

PARSERS = ("deepseek_r1", "qwen3")
START, END = "<think>", "</think>"


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of tag."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


class ReasoningParser:
    def __init__(self, kind: str):
        if kind not in PARSERS:
            raise ValueError(f"reasoning parser must be one of {', '.join(PARSERS)}; got {kind!r}")
        self.kind = kind

    def split(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole output (None where empty)."""
        s = ReasoningStream(self)
        r1, c1 = s.feed(text, final=True)
        return (r1 or None), (c1 or None)


class ReasoningStream:
    """One streamed choice (see the module doc)."""

    def __init__(self, parser: ReasoningParser):
        self.kind = parser.kind
        self.buf = ""                      # text not yet classified
        # "start": nothing decided yet; "reasoning": inside the think block; "content": after it.
        self.state = "start" if self.kind == "qwen3" else "open"

    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        self.buf += delta
        reasoning, content = "", ""
        while True:
            if self.state == "start":        # qwen3: a think block only if the output opens one
                stripped = self.buf.lstrip()
                if stripped.startswith(START):
                    self.buf, self.state = stripped[len(START):], "reasoning"
                    continue
                if not final and START.startswith(stripped):   # may still become <think>
                    break
                self.state = "content"
                continue
            if self.state == "open":         # deepseek_r1: reasoning from the start; drop a leading <think>
                stripped = self.buf.lstrip()
                if stripped.startswith(START):
                    self.buf, self.state = stripped[len(START):], "reasoning"
                    continue
                if not final and START.startswith(stripped):
                    break
                self.state = "reasoning"
                continue
            if self.state == "reasoning":
                at = self.buf.find(END)
                if at >= 0:
                    reasoning += self.buf[:at]
                    self.buf, self.state = self.buf[at + len(END):], "content"
                    continue
                keep = 0 if final else _partial_suffix(self.buf, END)
                reasoning += self.buf[:len(self.buf) - keep]
                self.buf = self.buf[len(self.buf) - keep:]
                break
            content += self.buf               # "content"
            self.buf = ""
            break
        return reasoning, content
