"""Tokenizers with one interface: SmolLM2's byte-level BPE (from GGUF metadata) and a byte tokenizer.

Both offer `encode(text) -> list[int]`, `decode(ids, skip_special_tokens=False) -> str`,
`apply_chat_template(prompt, system=None) -> str`, `apply_chat_messages(messages) -> str` and the properties `bos_token_id`,
`eos_token_id`, `vocab_size`, `stop_token_ids`.

`Tokenizer` rebuilds what transformers' GGUF loader builds for a `tokenizer.ggml.model == "gpt2"`
file (transformers 5.23, `integrations/gguf/gguf_tokenizer_mapping.py`): a byte-level BPE over
the file's tokens and merges, GPT-2's split regex, control tokens added as special tokens, no BOS
added by `encode` (the file says `add_bos_token = False`). It reproduces transformers' ids, which
tests/test_smollm2.py checks against tests/data/smollm2_golden.json.

A difference to know about: llama.cpp's "smollm" pre-tokenizer (by our reading of its
llama-vocab.cpp, as SmolLM2's own tokenizer.json) also splits every digit apart before GPT-2's regex. The vocabulary holds no token with a digit next
to another character, so this changes nothing except whitespace right before a digit: "a  1" is
["a", " ", " ", "1"] here and in transformers but ["a", "  ", "1"] in llama.cpp. We follow
transformers, the implementation the golden data comes from.
"""

import re

CHATML_START, CHATML_END = "<|im_start|>", "<|im_end|>"
_CONTROL = 3  # llama.cpp token type of control (special) tokens


def _chatml(prompt: str, system: str | None) -> str:
    head = "" if system is None else f"{CHATML_START}system\n{system}{CHATML_END}\n"
    return f"{head}{CHATML_START}user\n{prompt}{CHATML_END}\n{CHATML_START}assistant\n"


def _chatml_messages(messages, default_system: str | None) -> str:
    """ChatML for a conversation, ending with the assistant's generation prompt; `default_system`
    (if any) is added in front when the first message is not a system message."""
    if not messages:
        raise ValueError("apply_chat_messages: messages must not be empty")
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise ValueError(f"apply_chat_messages: messages[{i}] must be a dict with str 'role' and 'content'")
    head = []
    if default_system is not None and messages[0]["role"] != "system":
        head = [{"role": "system", "content": default_system}]
    turns = "".join(f"{CHATML_START}{m['role']}\n{m['content']}{CHATML_END}\n" for m in head + list(messages))
    return f"{turns}{CHATML_START}assistant\n"


def _check_ids(ids, vocab_size: int) -> list[int]:
    ids = [int(i) for i in ids]
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise ValueError(f"decode: ids must be in [0, vocab_size = {vocab_size}); got {bad[:5]}")
    return ids


class Tokenizer:
    """SmolLM2's byte-level BPE tokenizer (any GGUF with `tokenizer.ggml.model == "gpt2"`).

    Build it with `Tokenizer.from_gguf_metadata(metadata)` from `models.smollm2.read_gguf`'s metadata.
    """

    def __init__(self, tokens: list[str], merges: list[str], token_types: list[int] | None, *,
                 bos_token_id: int, eos_token_id: int, chat_template: str | None = None,
                 add_bos_token: bool = False):
        """Args:
          tokens: the vocabulary, index = id, spelled in GPT-2's byte alphabet ("Ġthe").
          merges: BPE merges, best first, each "left right".
          token_types: llama.cpp token types per id; type 3 (control) become special tokens.
          bos_token_id, eos_token_id: ids in the vocabulary.
          chat_template: the file's Jinja template; must be ChatML (we render it in Python).
          add_bos_token: prepend BOS in encode (SmolLM2: False).
        """
        from tokenizers import AddedToken, decoders, models, pre_tokenizers
        from tokenizers import Tokenizer as _HFTokenizer

        n = len(tokens)
        for name, val in (("bos_token_id", bos_token_id), ("eos_token_id", eos_token_id)):
            if not 0 <= val < n:
                raise ValueError(f"Tokenizer: {name} must be in [0, {n}); got {val}")
        if token_types is not None and len(token_types) != n:
            raise ValueError(f"Tokenizer: token_types must have one entry per token ({n}); got {len(token_types)}")
        vocab = {tok: i for i, tok in enumerate(tokens)}
        if len(vocab) != n:
            raise ValueError("Tokenizer: tokens must be distinct")
        pairs = [tuple(m.split(" ")) for m in merges]
        if any(len(p) != 2 for p in pairs):
            raise ValueError("Tokenizer: every merge must be two tokens separated by one space")
        tk = _HFTokenizer(models.BPE(vocab, pairs, fuse_unk=False, byte_fallback=False))
        tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tk.decoder = decoders.ByteLevel()
        self._special_ids = frozenset(
            i for i, t in enumerate(token_types or ()) if t == _CONTROL)
        tk.add_special_tokens([AddedToken(tokens[i], normalized=False, special=True)
                               for i in sorted(self._special_ids)])
        self._tk = tk
        self._tokens = list(tokens)
        self._bos, self._eos = int(bos_token_id), int(eos_token_id)
        self._add_bos = bool(add_bos_token)
        self._default_system = None
        self._chat_ok = chat_template is not None and CHATML_START in chat_template and CHATML_END in chat_template
        if chat_template is not None and self._chat_ok:
            # SmolLM2's template inserts a default system message when the first is not "system".
            m = re.search(r"messages\[0\]\['role'\] != 'system' %\}\{\{ '" + re.escape(CHATML_START)
                          + r"system\n(.*?)" + re.escape(CHATML_END), chat_template, re.S)
            self._default_system = m.group(1) if m else None
        end = [i for i, t in enumerate(tokens) if t in ("<|endoftext|>", CHATML_END)]
        self._stop = tuple(dict.fromkeys([self._eos, *end]))

    @classmethod
    def from_gguf_metadata(cls, metadata: dict) -> "Tokenizer":
        """From the metadata dict of models.smollm2.read_gguf (or read_gguf_metadata)."""
        tok = metadata["tokenizer"]
        if tok["model"] != "gpt2":
            raise ValueError(f"Tokenizer builds byte-level BPE (tokenizer.ggml.model 'gpt2'); the file "
                             f"says {tok['model']!r}")
        if not tok.get("merges"):
            raise ValueError("Tokenizer: the GGUF file has no tokenizer.ggml.merges")
        return cls(tok["tokens"], tok["merges"], tok.get("token_types"),
                   bos_token_id=metadata["bos_token_id"], eos_token_id=metadata["eos_token_id"],
                   chat_template=metadata.get("chat_template"), add_bos_token=tok.get("add_bos_token", False))

    @property
    def bos_token_id(self) -> int:
        return self._bos

    @property
    def eos_token_id(self) -> int:
        """<|im_end|> for SmolLM2: the end of a chat turn."""
        return self._eos

    @property
    def vocab_size(self) -> int:
        return len(self._tokens)

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """Ids that end generation: eos first, then <|endoftext|> / <|im_end|> when present."""
        return self._stop

    @property
    def default_system_prompt(self) -> str | None:
        """The system message the chat template adds when none is given (None if it adds none)."""
        return self._default_system

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; special tokens written in the text (e.g. "<|im_start|>") stay whole."""
        if not isinstance(text, str):
            raise ValueError(f"encode: text must be a str; got {type(text).__name__}")
        ids = self._tk.encode(text, add_special_tokens=False).ids
        return [self._bos, *ids] if self._add_bos else ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        """Text of `ids` (ints in [0, vocab_size)); drops control tokens if skip_special_tokens."""
        return self._tk.decode(_check_ids(ids, self.vocab_size), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str:
        return self._tokens[token_id]

    def apply_chat_template(self, prompt: str, system: str | None = None) -> str:
        """One user turn in ChatML, ending with the assistant's generation prompt.

        Renders what the file's template renders for messages [system?, user] with
        add_generation_prompt=True: without `system`, the template's default system message
        (SmolLM2: "You are a helpful AI assistant named SmolLM, trained by Hugging Face").
        """
        if not self._chat_ok:
            raise ValueError("apply_chat_template: this tokenizer's GGUF file has no ChatML chat template")
        return _chatml(prompt, self._default_system if system is None else system)

    def apply_chat_messages(self, messages) -> str:
        """A conversation [{"role": ..., "content": ...}, ...] in ChatML with the generation prompt,
        as the file's template renders it (its default system message added when the first
        message is not a system message)."""
        if not self._chat_ok:
            raise ValueError("apply_chat_messages: this tokenizer's GGUF file has no ChatML chat template")
        return _chatml_messages(messages, self._default_system)


class ByteTokenizer:
    """UTF-8 bytes as tokens, for the random-init tiny models.

    Ids 0..255 are the bytes; 256 = "<bos>", 257 = "<eos>", 258 = "<pad>". vocab_size is 512 (the
    tiny presets' vocabulary); ids 259..511 are unused and decode to nothing. `encode` adds no BOS
    and treats special-token names in the text as plain bytes. Chat templates render ChatML as
    plain text (a random model has no chat format to match).
    """

    BOS, EOS, PAD = 256, 257, 258
    VOCAB_SIZE = 512
    _NAMES = {256: "<bos>", 257: "<eos>", 258: "<pad>"}

    @property
    def bos_token_id(self) -> int:
        return self.BOS

    @property
    def eos_token_id(self) -> int:
        return self.EOS

    @property
    def vocab_size(self) -> int:
        return self.VOCAB_SIZE

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return (self.EOS,)

    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"encode: text must be a str; got {type(text).__name__}")
        return list(text.encode("utf-8"))

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        """Bytes decode as UTF-8 (invalid sequences become U+FFFD); specials as their names unless
        skip_special_tokens; unused ids (259..511) decode to nothing."""
        ids = _check_ids(ids, self.VOCAB_SIZE)
        out, run = [], bytearray()
        for i in ids:
            if i < 256:
                run.append(i)
                continue
            out.append(run.decode("utf-8", errors="replace"))
            run = bytearray()
            if i in self._NAMES and not skip_special_tokens:
                out.append(self._NAMES[i])
        out.append(run.decode("utf-8", errors="replace"))
        return "".join(out)

    def apply_chat_template(self, prompt: str, system: str | None = None) -> str:
        return _chatml(prompt, system)

    def apply_chat_messages(self, messages) -> str:
        return _chatml_messages(messages, None)
