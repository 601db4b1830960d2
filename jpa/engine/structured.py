"""Structured outputs: a request's output constrained by a JSON schema, a regex, a choice or a grammar.

Host side of constrained decoding, on llguidance (the grammar library vLLM and SGLang use; Rust,
an abi3 wheel, no PyTorch). Three pieces:

- `StructuredOutputs` (`SamplingParams.structured`): what the output must match, validated and
  compiled once when it is made (a bad schema, regex or grammar is a ValueError naming the field).
- `Grammars` (one per engine): the engine tokenizer's vocabulary as an llguidance `LLTokenizer`
  (built on first use), compiled grammars (cached by grammar text), and `masks`: the allowed-token
  bitmask of every constrained row of a round, from each request's matcher.
- `Matcher` (`Request.matcher`): one request's grammar state, fed the request's output tokens
  as they arrive (`StructuredHook.post`). Each parallel sample has its own copy.

How masks reach the device (see `jpa.engine.runner`): a constrained request samples only in the
ragged step of a round, where it has one decode row; the host computes that row's bitmask from
its matcher (which has consumed every output token so far) and sends it in the StepBatch
(`allowed`, `constrained`). The sampler sets disallowed logits to -inf after the logit controls
(penalties, logit_bias, min_tokens) and before temperature and top-k/top-p/min-p, so a token's
logprob (and top_logprobs) is under the masked distribution, as in vLLM. The decode loop runs
without constrained slots (their `SlotParams.constrained`), so unconstrained requests in the same
batch keep their `steps_per_call` tokens per round; a constrained request makes one token per
round.

EOS: the mask allows the engine's stop tokens only where the grammar accepts. Once the grammar
admits nothing more (`Matcher.done`, e.g. the closing brace of a JSON object), the request
finishes with finish_reason "stop" on the host, without waiting for an EOS token (as with a stop
string; with ignore_eos too).

Preemption by recompute keeps a request's output tokens, and its matcher with them: it has
consumed exactly those tokens, so decoding resumes in the same grammar state.

Tokenizer protocol (`Grammars(tokenizer, ...)`): a tokenizer with `backend_tokenizer`, a Hugging
Face `tokenizers.Tokenizer` (jpa's SmolLM2 and Hugging Face tokenizers), is read from its JSON
(special tokens, byte-level pieces and SentencePiece byte fallback as the file defines them); a
tokenizer with `token_bytes_table()` -> (bytes of each id, special ids) (jpa's ByteTokenizer) is
wrapped as it is.

Where the feature plugs into the engine (its hook points; nothing else in the engine names it):
- plan: `StructuredHook.plan`, one of the scheduler's request hooks (`Scheduler(hooks=...)`):
  a decoding constrained request needs a ragged row every round;
- batch fields: `StepBatch.structured` (`GrammarMasks`), filled by `LLMEngine` from
  `Grammars.masks` (`constrained_rows` picks the entries);
- device hook on the logits: `sample_slots(allowed=...)` in the ragged pass; before the verify
  loop, `hold_constrained` takes constrained slots out of it and `restore_held` puts them back;
- post-process: `StructuredHook.post`, called by the scheduler on each request's new tokens: it
  feeds them to the request's matcher and says when the grammar ends the request.
"""

import dataclasses
import functools
import json
import time

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

# JSON schemas compile to compact JSON (no whitespace between tokens) unless the schema's own
# "x-guidance" options say otherwise: with arbitrary whitespace allowed, small models are known to
# emit newlines forever (vLLM added `disable_any_whitespace` for this).
JSON_DEFAULTS = {"whitespace_flexible": False}
FIELDS = ("json", "json_object", "regex", "choice", "grammar")


def _llguidance():
    try:
        import llguidance
    except ImportError as e:  # an optional dependency (extras serve/model/test)
        raise ValueError("structured outputs need the llguidance package (pip install llguidance)") from e
    return llguidance


def _short(message: str) -> str:
    """An llguidance error on one line, without the parser state and grammar it appends."""
    for marker in ("<state>", "<grammar>"):
        message = message.split(marker)[0]
    return " ".join(message.split())[:400]


@dataclasses.dataclass(frozen=True)
class Reasoning:
    """Free text before a constraint: a reasoning model's thought (`StructuredOutputs.reasoning`).

    The constraint applies to the answer after the thought's end marker; until that marker is
    generated, sampling is free (bounded by max_new_tokens, as any output). It is one grammar,
    "thought, then the constraint", so the engine keeps no state of its own for it.

    Attributes:
      start, end: the markers (DeepSeek-R1's and Qwen3's `<think>`, `</think>`).
      optional: False (DeepSeek-R1: the output begins inside the thought; a leading `start`, after
        whitespace, is allowed): the answer comes after the first `end`. True (Qwen3): an output
        that opens with `start` (after whitespace) is a thought up to the first `end`; any other
        output is the answer from its first token.
      special: the markers are special tokens of the tokenizer (llguidance reads every added token
        of a Hugging Face tokenizer as special, Qwen3's and DeepSeek-R1's think tags included): the
        grammar names them as tokens, and the thought is any text without special tokens. False:
        they are text, and the thought ends at the first occurrence of `end` (a lazy match).
    """
    start: str = "<think>"
    end: str = "</think>"
    optional: bool = False
    special: bool = False

    def __post_init__(self):
        for name in ("start", "end"):
            v = getattr(self, name)
            if not isinstance(v, str) or not v:
                raise ValueError(f"structured.reasoning.{name} must be a non-empty string; got {v!r}")
            if self.special and not (v.startswith("<") and v.endswith(">") and len(v) > 2
                                     and not any(c.isspace() or c in "<>" for c in v[1:-1])):
                raise ValueError(f"structured.reasoning.{name}: a special token is named <name> here; got {v!r}")
        for name in ("optional", "special"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"structured.reasoning.{name} must be a bool; got {getattr(self, name)!r}")

    @classmethod
    def of(cls, value) -> "Reasoning | None":
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, dict):
            unknown = sorted(set(value) - {f.name for f in dataclasses.fields(cls)})
            if unknown:
                raise ValueError(f"structured.reasoning: unknown field(s) {unknown}")
            return cls(**value)
        raise ValueError(f"structured.reasoning must be a Reasoning or a dict of its fields; got {type(value).__name__}")

    def lark(self) -> str:
        """The outer Lark grammar: the thought, then `@answer` (the constraint's own grammar)."""
        text = 'THOUGHT: /(.|\\n)*/\n'
        if self.special:   # special tokens: the free text cannot contain them, so it ends at `end`
            # ... nor `end` spelled in ordinary tokens (a parser of the text would end the thought there)
            text = f'THOUGHT: /(.|\\n)*/ & ~(/(.|\\n)*/ {json.dumps(self.end)} /(.|\\n)*/)\n'
            head = f"/[ \\t\\r\\n]*/ {self.start}"
            if self.optional:
                return f"start: thought @answer | @answer\nthought: {head} THOUGHT {self.end}\n" + text
            return f"start: ({head})? THOUGHT {self.end} @answer\n" + text
        start, end = json.dumps(self.start), json.dumps(self.end)
        if self.optional:   # lazy: the thought is one lexeme that ends at the first `end`
            return (f"start: thought @answer | @answer\nthought[lazy]: /[ \\t\\r\\n]*/ {start} THOUGHT {end}\n"
                    + text)
        return f"start: thought @answer\nthought[lazy]: THOUGHT {end}\n" + text


def _after_reasoning(text: str, reasoning: Reasoning) -> str:
    """A top-level llguidance grammar: the thought (reasoning.lark()), then the grammar `text`."""
    if text.lstrip().startswith("{"):   # llguidance's JSON form: {"grammars": [...], ...}
        top = json.loads(text)
        grammars = top["grammars"]
    else:                               # Lark text
        top, grammars = {}, [{"lark_grammar": text}]
    answer = {**grammars[0], "name": "answer"}
    return json.dumps({**top, "grammars": [{"name": "reasoning", "lark_grammar": reasoning.lark()}, answer,
                                           *grammars[1:]]})


@functools.lru_cache(maxsize=256)
def _grammar_text(kind: str, value, reasoning: "Reasoning | None" = None) -> str:
    """The llguidance grammar of a constraint (after a thought when reasoning is given); ValueError
    with llguidance's message if it does not compile (a malformed regex or Lark grammar, a JSON
    schema it cannot handle)."""
    llg = _llguidance()
    if kind == "json":
        text = llg.LLMatcher.grammar_from_json_schema(value, defaults=JSON_DEFAULTS)
    elif kind == "json_object":
        text = llg.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=JSON_DEFAULTS)
    elif kind == "regex":
        text = llg.LLMatcher.grammar_from_regex(value)
    elif kind == "choice":
        text = llg.grammar_from("choice", list(value))
    else:  # a Lark grammar (llguidance's dialect) or a GBNF one (converted)
        try:
            text = llg.grammar_from("grammar", value)
        except ValueError as e:
            raise ValueError(_short(str(e))) from None
    if reasoning is not None:
        text = _after_reasoning(text, reasoning)
    error = llg.LLMatcher.validate_grammar(text)
    if error:
        raise ValueError(_short(error))
    return text


@dataclasses.dataclass(frozen=True)
class StructuredOutputs:
    """What a request's output must match (vLLM's StructuredOutputsParams): exactly one of

    Attributes:
      json: a JSON schema (a dict, or its JSON text; kept as text so the params stay hashable).
        Output is compact JSON (see JSON_DEFAULTS; a schema's "x-guidance" options override it).
      json_object: True: any JSON object (OpenAI's response_format json_object).
      regex: a regular expression the whole output matches (Rust `regex` syntax).
      choice: one of these strings exactly.
      grammar: a context-free grammar, Lark syntax as llguidance reads it (GBNF is converted).
    and optionally
      reasoning: a `Reasoning` (or a dict of its fields): the constraint applies to the answer after
        a free thought (a reasoning model's `<think>...</think>`); None: to the whole output.

    Raises:
      ValueError naming the field: none or more than one given, a wrong type, or a constraint
      llguidance cannot compile (its message).
    """
    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    reasoning: Reasoning | None = None

    def __post_init__(self):
        object.__setattr__(self, "reasoning", Reasoning.of(self.reasoning))
        given = [f for f in FIELDS if getattr(self, f) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured outputs need exactly one of {', '.join(FIELDS)}; got "
                             f"{', '.join(given) or 'none'}")
        if not isinstance(self.json_object, bool):
            raise ValueError(f"structured.json_object must be a bool; got {self.json_object!r}")
        if self.json is not None:
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except ValueError as e:
                    raise ValueError(f"structured.json: not valid JSON: {e}") from None
            if not isinstance(schema, dict):
                raise ValueError(f"structured.json must be a JSON schema object (a dict or its JSON text); "
                                 f"got {type(schema).__name__}")
            try:
                text = json.dumps(schema, ensure_ascii=False, allow_nan=False)
            except (TypeError, ValueError) as e:
                raise ValueError(f"structured.json: the schema is not serializable as JSON: {e}") from None
            object.__setattr__(self, "json", text)
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise ValueError(f"structured.{name} must be a non-empty string; got {v!r}")
        if self.choice is not None:
            choice = (self.choice,) if isinstance(self.choice, str) else self.choice
            if not isinstance(choice, (list, tuple)) or not choice or any(not isinstance(c, str) or not c
                                                                          for c in choice):
                raise ValueError(f"structured.choice must be a non-empty list of non-empty strings; got "
                                 f"{self.choice!r}")
            object.__setattr__(self, "choice", tuple(choice))
        try:
            self.grammar_text()
        except ValueError as e:
            raise ValueError(f"structured.{self.kind}: {e}") from None

    @property
    def kind(self) -> str:
        """The field that is set: "json", "json_object", "regex", "choice" or "grammar"."""
        return next(f for f in FIELDS if getattr(self, f) not in (None, False))

    def grammar_text(self) -> str:
        """The llguidance grammar (compiled-checked; cached)."""
        kind = self.kind
        return _grammar_text(kind, None if kind == "json_object" else getattr(self, kind), self.reasoning)

    @classmethod
    def of(cls, value) -> "StructuredOutputs | None":
        """A StructuredOutputs from itself, a dict of its fields, or None."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, dict):
            unknown = sorted(set(value) - {*FIELDS, "reasoning"})
            if unknown:
                raise ValueError(f"structured: unknown field(s) {unknown}; the fields are {', '.join(FIELDS)}, "
                                 f"reasoning")
            return cls(**value)
        raise ValueError(f"structured must be a StructuredOutputs or a dict of its fields; got "
                         f"{type(value).__name__}")


class Matcher:
    """One request's grammar state: an llguidance LLMatcher and how many output tokens it consumed."""

    def __init__(self, matcher):
        self._m = matcher
        self.consumed = 0

    def copy(self) -> "Matcher":
        """An independent copy in the same state (a parallel sample's own matcher)."""
        other = Matcher(self._m.deep_copy())
        other.consumed = self.consumed
        return other

    def advance(self, output_ids) -> str | None:
        """Consumes the output tokens it has not seen (output_ids: the request's whole output).
        Returns None, or an error message when a token does not satisfy the grammar (the sampler
        only draws allowed tokens, so this means a bug)."""
        new = list(output_ids[self.consumed:])
        if new and not self._m.consume_tokens(new):
            return f"structured outputs: the grammar rejected an output token ({_short(self._m.get_error())})"
        self.consumed += len(new)
        return None

    @property
    def done(self) -> bool:
        """The grammar admits nothing more (but EOS): the output is complete."""
        return self._m.is_stopped()

    def fill(self, row: np.ndarray) -> None:
        """Writes the allowed-token bitmask of the next token into row (i32[ceil(vocab / 32)]):
        bit t % 32 of word t // 32 is set where token t is allowed."""
        self._m.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)


class Grammars:
    """An engine's grammar side: its tokenizer for llguidance, compiled grammars, the round's masks.

    Args:
      tokenizer: the engine's tokenizer (see the module doc for what it must offer).
      vocab_size: the model's vocabulary (the width of its logits; ids past the tokenizer's
        vocabulary are never allowed).
      stop_ids: the engine's stop tokens (EOS): allowed where the grammar accepts.

    Attributes (running sums): compile_seconds / compiles (grammar compilations, cache misses),
      mask_seconds / masks (bitmask computations, one per constrained row), tokenizer_seconds.
    """

    def __init__(self, tokenizer, vocab_size: int, stop_ids):
        self.tokenizer, self.vocab_size, self.stop_ids = tokenizer, int(vocab_size), sorted(stop_ids)
        self.words = -(-self.vocab_size // 32)
        self._llt = None
        self._compiled: dict[str, object] = {}   # grammar text -> a pristine LLMatcher (copied per request)
        self.compile_seconds, self.compiles = 0.0, 0
        self.mask_seconds, self.masks_computed = 0.0, 0
        self.tokenizer_seconds = 0.0

    def llg_tokenizer(self):
        """The llguidance LLTokenizer of the engine's vocabulary (built once; ~0.5 s for 49k tokens)."""
        if self._llt is None:
            llg = _llguidance()
            t0 = time.perf_counter()
            tok = self.tokenizer
            backend = getattr(tok, "backend_tokenizer", None)
            if backend is not None:
                source = backend.to_str()
            elif callable(getattr(tok, "token_bytes_table", None)):
                source = llg.TokenizerWrapper(_TableTokenizer(tok))
            else:
                raise ValueError(f"structured outputs need a tokenizer with `backend_tokenizer` (a Hugging Face "
                                 f"tokenizers.Tokenizer) or `token_bytes_table()`; {type(tok).__name__} has neither")
            try:
                self._llt = llg.LLTokenizer(source, n_vocab=self.vocab_size, eos_token=self.stop_ids)
            except Exception as e:  # llguidance raises plain exceptions for vocabularies it cannot read
                raise ValueError(f"structured outputs: llguidance cannot read this tokenizer: {_short(str(e))}") from e
            self.tokenizer_seconds = time.perf_counter() - t0
        return self._llt

    def matcher(self, spec: StructuredOutputs) -> Matcher:
        """A fresh Matcher for spec (compiled once per grammar text, then copied)."""
        text = spec.grammar_text()
        base = self._compiled.get(text)
        if base is None:
            llg = _llguidance()
            t0 = time.perf_counter()
            base = llg.LLMatcher(self.llg_tokenizer(), text, log_level=0)
            self.compile_seconds += time.perf_counter() - t0
            self.compiles += 1
            if base.is_error():
                raise ValueError(f"structured.{spec.kind}: {_short(base.get_error())}")
            if len(self._compiled) >= 256:   # a long-lived server: forget the oldest
                self._compiled.pop(next(iter(self._compiled)))
            self._compiled[text] = base
        return Matcher(base.deep_copy())

    def masks(self, rows) -> dict[int, np.ndarray]:
        """{row: i32[words] allowed-token bitmask} for rows, a list of (row, Matcher)."""
        out = {}
        t0 = time.perf_counter()
        for i, m in rows:
            row = np.zeros((self.words,), np.int32)
            m.fill(row)
            out[i] = row
        self.mask_seconds += time.perf_counter() - t0
        self.masks_computed += len(out)
        return out


class StructuredHook:
    """Structured outputs at the scheduler's request hook points (`jpa.engine.scheduler.Scheduler`'s
    `hooks`; `STRUCTURED` is the one instance). A hook has two methods:

      plan(req) -> bool: the decoding request needs a ragged row this round (even a round without
        prompt work then runs the ragged step, and steps_per_call - 1 decode steps after it);
      post(req, device_done) -> (finish_reason, error) | None: after the request's new tokens were
        recorded (req.output_ids); what ends it on the host, if anything (the scheduler releases its
        slot, as for a stop string). device_done: the device finished it already (EOS, length).
    """

    @staticmethod
    def plan(req) -> bool:
        """A constrained request samples only in the ragged step, under its grammar mask (the decode
        loop holds it out: `hold_constrained`), so it needs a ragged row every round it decodes."""
        return req.matcher is not None

    @staticmethod
    def post(req, device_done: bool):
        """Feeds the request's new output tokens to its matcher: ("stop", None) once the grammar
        admits nothing more (the output is complete, though the device still decodes it), ("error",
        message) when the grammar rejected a token (a bug: the sampler draws only allowed tokens),
        else None. Nothing to do once the device finished the request."""
        if req.matcher is None or device_done:
            return None
        error = req.matcher.advance(req.output_ids)
        if error is not None:
            return "error", error
        return ("stop", None) if req.matcher.done else None


STRUCTURED = StructuredHook()


class _TableTokenizer:
    """llguidance's "gtokenizer" protocol over `token_bytes_table()` (bytes per id, special ids)."""

    def __init__(self, tokenizer):
        self._tok = tokenizer
        self.tokens, self.special_token_ids = tokenizer.token_bytes_table()
        self.eos_token_id = tokenizer.eos_token_id
        self.bos_token_id = getattr(tokenizer, "bos_token_id", None)

    def __call__(self, text: str) -> list[int]:
        return list(self._tok.encode(text))


# ---------------------------------------------------------------------- the engine's hooks

@flax.struct.dataclass
class GrammarMasks:
    """The feature's record of a round's `StepBatch` (`StepBatch.structured`).

    Attributes:
      allowed: i32[B, ceil(vocab / 32)]; the allowed-token bitmask of an entry that samples under
        a grammar (bit t % 32 of word t // 32 = token t).
      constrained: bool[B]; the entry samples under its `allowed` row (False: no mask).
    """
    allowed: jax.Array
    constrained: jax.Array


def allowed_rows(masks: GrammarMasks, vocab: int):
    """bool[B, vocab]: the device hook on the ragged pass's logits: each constrained row's grammar
    mask, everything allowed elsewhere (applied by `sample_slots(allowed=...)` after the logit
    controls, before temperature and the filters)."""
    return ~masks.constrained[:, None] | allowed_tokens(masks.allowed, vocab)


def allowed_tokens(bitmask, vocab: int):
    """bool[n, vocab] from an allowed-token bitmask i32[n, ceil(vocab / 32)] (llguidance's layout:
    bit t % 32 of word t // 32 is token t)."""
    t = jnp.arange(vocab, dtype=jnp.int32)
    return ((bitmask[:, t // 32] >> (t % 32)) & 1).astype(bool)


def constrained_rows(plan) -> list:
    """(entry index, matcher) of each entry of a RoundPlan that samples under a grammar: a decode
    row, or a final chunk that draws the request's first token (a resumed request's is drawn)."""
    return [(i, e.request.matcher) for i, e in enumerate(plan.entries) if e.request.matcher is not None
            and (e.decode or (e.final and not e.request.output_ids))]


def hold_constrained(slots):
    """(slots without the active constrained ones, which those were): constrained slots sample
    only in the ragged step (under the host's grammar mask); the verify loop runs without them."""
    held = slots.active & slots.params.constrained
    return slots.replace(active=slots.active & ~held), held


def restore_held(slots, held):
    """The slots held out of the verify loop come back as they were."""
    return slots.replace(active=slots.active | held)
