"""Tokenizers with one interface: SmolLM2's byte-level BPE (from GGUF metadata), a Hugging Face
tokenizer directory (HFTokenizer: tokenizer.json + chat template) and a byte tokenizer.

All offer `encode(text) -> list[int]`, `decode(ids, skip_special_tokens=False) -> str`,
`apply_chat_template(prompt, system=None) -> str`, `render_chat(messages) -> str` (a whole
conversation, what the server renders) and the properties `bos_token_id`,
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


# Tool calling in ChatML, the Hermes way, as Qwen2.5's chat template renders it (tools listed in the
# system turn, calls as <tool_call> JSON, results as <tool_response> in a user turn).
_TOOLS_HEAD = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided "
               "with function signatures within <tools></tools> XML tags:\n<tools>")
_TOOLS_TAIL = ("\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
               "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
               "<args-json-object>}\n</tool_call>")


def _chatml_messages(messages, default_system: str | None, add_generation_prompt: bool = True, tools=None) -> str:
    """ChatML for a conversation (ending with the assistant's generation prompt if asked);
    `default_system` (if any) is added in front when the first message is not a system message.
    With `tools` (OpenAI tool definitions) the tools are rendered as Qwen2.5's template does
    (Hermes style): listed in the system turn; an assistant message's `tool_calls` become
    <tool_call> JSON blocks, `tool` messages <tool_response> blocks in a user turn."""
    import json

    if not messages:
        raise ValueError("render_chat: messages must not be empty")
    for i, m in enumerate(messages):
        calls = isinstance(m, dict) and m.get("role") == "assistant" and m.get("tool_calls")
        if not (isinstance(m, dict) and isinstance(m.get("role"), str)
                and (isinstance(m.get("content"), str) or (calls and m.get("content") is None))):
            raise ValueError(f"render_chat: messages[{i}] must be a dict with str 'role' and 'content'")
    messages = list(messages)
    system = messages.pop(0)["content"] if messages[0]["role"] == "system" else default_system
    if tools:
        listed = "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools)
        system = (f"{system}\n\n" if system else "") + _TOOLS_HEAD + listed + _TOOLS_TAIL
    turns = [] if system is None else [f"{CHATML_START}system\n{system}{CHATML_END}\n"]
    for i, m in enumerate(messages):
        content = m.get("content") or ""
        if m["role"] == "tool":   # consecutive tool results share one user turn
            first = i == 0 or messages[i - 1]["role"] != "tool"
            last = i == len(messages) - 1 or messages[i + 1]["role"] != "tool"
            turns.append((f"{CHATML_START}user" if first else "") + f"\n<tool_response>\n{content}\n</tool_response>"
                         + (f"{CHATML_END}\n" if last else ""))
            continue
        for call in m.get("tool_calls") or ():
            f = call.get("function", call)
            content += ("\n" if content else "") + "<tool_call>\n" + json.dumps(
                {"name": f.get("name"), "arguments": f.get("arguments")}, ensure_ascii=False) + "\n</tool_call>"
        turns.append(f"{CHATML_START}{m['role']}\n{content}{CHATML_END}\n")
    turns = "".join(turns)
    return f"{turns}{CHATML_START}assistant\n" if add_generation_prompt else turns


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
        # encode_batch releases Python's lock while it works (encode holds it: a long prompt
        # would stall every other thread, e.g. a server's event loop).
        ids = self._tk.encode_batch([text], add_special_tokens=False)[0].ids
        return [self._bos, *ids] if self._add_bos else ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        """Text of `ids` (ints in [0, vocab_size)); drops control tokens if skip_special_tokens."""
        return self._tk.decode(_check_ids(ids, self.vocab_size), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str:
        return self._tokens[token_id]

    @property
    def backend_tokenizer(self):
        """The Hugging Face `tokenizers.Tokenizer` underneath (structured outputs read its JSON)."""
        return self._tk

    def apply_chat_template(self, prompt: str, system: str | None = None) -> str:
        """One user turn in ChatML, ending with the assistant's generation prompt.

        Renders what the file's template renders for messages [system?, user] with
        add_generation_prompt=True: without `system`, the template's default system message
        (SmolLM2: "You are a helpful AI assistant named SmolLM, trained by Hugging Face").
        """
        if not self._chat_ok:
            raise ValueError("apply_chat_template: this tokenizer's GGUF file has no ChatML chat template")
        return _chatml(prompt, self._default_system if system is None else system)

    def render_chat(self, messages, add_generation_prompt: bool = True, tools=None) -> str:
        """A conversation [{"role": ..., "content": ...}, ...] in ChatML (with the generation prompt
        unless told otherwise), as the file's template renders it (its default system message
        added when the first message is not a system message). The file's template has no tool
        section: `tools` are rendered Hermes-style, as Qwen2.5's template does (`_chatml_messages`)."""
        if not self._chat_ok:
            raise ValueError("render_chat: this tokenizer's GGUF file has no ChatML chat template")
        return _chatml_messages(messages, self._default_system, add_generation_prompt, tools)


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

    def token_bytes_table(self) -> tuple[list[bytes], list[int]]:
        """(the bytes of each id, the special ids): the vocabulary as structured outputs read it.
        Special tokens are spelled by their names; unused ids are empty (never allowed)."""
        table = [bytes([i]) for i in range(256)] + [b""] * (self.VOCAB_SIZE - 256)
        for i, name in self._NAMES.items():
            table[i] = name.encode()
        return table, sorted(self._NAMES)

    def apply_chat_template(self, prompt: str, system: str | None = None) -> str:
        return _chatml(prompt, system)

    def render_chat(self, messages, add_generation_prompt: bool = True, tools=None) -> str:
        return _chatml_messages(messages, None, add_generation_prompt, tools)

class HFTokenizer:
    """A Hugging Face tokenizer directory: tokenizer.json (via `tokenizers`), the chat template and
    the special tokens of tokenizer_config.json, stop ids from generation_config.json.

    Build it with `HFTokenizer.from_dir(path)` (models.hf.load does). Same interface as
    `Tokenizer`, plus `render_chat(messages)` for whole conversations.

    `encode(text)` applies tokenizer.json's post-processor (the BOS that Llama-3 and Gemma add), as
    transformers' `tokenizer(text)` does, except when the text already starts with the BOS token: a
    rendered chat template carries its own, and transformers' `apply_chat_template(tokenize=True)`
    then adds none either.
    """

    def __init__(self, tokenizer, *, special_tokens: dict, bos_token_id: int | None, eos_token_id: int,
                 stop_token_ids, chat_template: str | None, source: str = "tokenizer"):
        self._tk = tokenizer
        self._special_tokens = dict(special_tokens)
        self._bos = bos_token_id
        self._eos = int(eos_token_id)
        self._stop = tuple(dict.fromkeys([self._eos, *(int(i) for i in stop_token_ids)]))
        self._chat_template = chat_template
        self._source = source
        bos = self._special_tokens.get("bos_token")
        self._bos_text = bos if bos and self._bos is not None else None

    @classmethod
    def from_dir(cls, path, generation_config: dict | None = None, model_config: dict | None = None):
        """Reads tokenizer.json, tokenizer_config.json (optional) and chat_template.jinja (optional).

        Args:
          path: the checkpoint directory.
          generation_config: generation_config.json's contents (eos_token_id: an id or a list of
            stop ids), or None.
          model_config: config.json's contents (bos/eos_token_id fallbacks), or None.

        Raises:
          FileNotFoundError: no tokenizer.json. ValueError: unreadable files or unknown special tokens.
        """
        import pathlib

        from tokenizers import Tokenizer as _HFTokenizer

        path = pathlib.Path(path)
        tj = path / "tokenizer.json"
        if not tj.is_file():
            raise FileNotFoundError(f"{path}: no tokenizer.json (jpa reads Hugging Face 'fast' tokenizers "
                                    f"only; convert a sentencepiece tokenizer.model with transformers first)")
        try:
            tk = _HFTokenizer.from_file(str(tj))
        except Exception as e:  # tokenizers raises a bare Exception on parse errors
            raise ValueError(f"{tj} is not a readable tokenizers file: {e}") from e
        tc = _read_json(path / "tokenizer_config.json") or {}
        gc, mc = generation_config or {}, model_config or {}
        special = {}
        for name in ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                     "mask_token"):
            val = tc.get(name)
            if isinstance(val, dict):  # an AddedToken serialized as {"content": ...}
                val = val.get("content")
            if isinstance(val, str):
                special[name] = val

        def token_id(name):
            text = special.get(name)
            if text is None:
                return None
            i = tk.token_to_id(text)
            if i is None:
                raise ValueError(f"{path / 'tokenizer_config.json'}: {name} {text!r} is not in tokenizer.json's "
                                 f"vocabulary")
            return i

        def ids(val):
            return [val] if isinstance(val, int) else list(val or [])

        gen_eos = ids(gc.get("eos_token_id"))
        eos = token_id("eos_token")
        eos = eos if eos is not None else (gen_eos or ids(mc.get("eos_token_id")) or [None])[0]
        if eos is None:
            raise ValueError(f"{path}: no eos token in tokenizer_config.json, generation_config.json or "
                             f"config.json")
        bos = token_id("bos_token")
        if bos is None:
            bos = gc.get("bos_token_id", mc.get("bos_token_id"))
        chat = tc.get("chat_template")
        if isinstance(chat, list):  # named templates: [{"name": "default", "template": ...}, ...]
            chat = {t.get("name"): t.get("template") for t in chat}.get("default")
        jinja_file = path / "chat_template.jinja"  # transformers 5 saves the template here
        if jinja_file.is_file():
            chat = jinja_file.read_text(encoding="utf-8")
        return cls(tk, special_tokens=special, bos_token_id=bos, eos_token_id=eos,
                   stop_token_ids=gen_eos + ids(mc.get("eos_token_id")), chat_template=chat, source=str(path))

    @property
    def bos_token_id(self) -> int | None:
        return self._bos

    @property
    def eos_token_id(self) -> int:
        return self._eos

    @property
    def vocab_size(self) -> int:
        return self._tk.get_vocab_size(with_added_tokens=True)

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """eos first, then generation_config.json's eos_token_id list (Llama-3: <|eot_id|>, ...)."""
        return self._stop

    @property
    def special_tokens(self) -> dict:
        """The named special tokens of tokenizer_config.json ({"bos_token": "<bos>", ...})."""
        return dict(self._special_tokens)

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, with the post-processor's special tokens unless the text already
        starts with the BOS token (see the class docstring)."""
        if not isinstance(text, str):
            raise ValueError(f"encode: text must be a str; got {type(text).__name__}")
        add = not (self._bos_text and text.startswith(self._bos_text))
        return self._tk.encode_batch([text], add_special_tokens=add)[0].ids   # releases the lock (see above)

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        """Text of `ids` (ints >= 0). Ids past the tokenizer's vocabulary (the padding rows of a
        model whose vocab_size is rounded up, as Qwen's) decode to nothing."""
        ids = [int(i) for i in ids]
        if any(i < 0 for i in ids):
            raise ValueError(f"decode: ids must be >= 0; got {[i for i in ids if i < 0][:5]}")
        return self._tk.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tk.id_to_token(token_id)

    @property
    def backend_tokenizer(self):
        """The Hugging Face `tokenizers.Tokenizer` (structured outputs read its JSON)."""
        return self._tk

    def render_chat(self, messages, add_generation_prompt: bool = True, **kwargs) -> str:
        """The conversation rendered by the checkpoint's chat template (models.chat_template.render)."""
        from jpa.models.chat_template import render

        if self._chat_template is None:
            raise ValueError(f"{self._source}: the checkpoint has no chat template (tokenizer_config.json "
                             f"'chat_template' or chat_template.jinja); pass plain prompts instead")
        return render(self._chat_template, messages, add_generation_prompt=add_generation_prompt,
                      special_tokens=self._special_tokens, **kwargs)

    def apply_chat_template(self, prompt: str, system: str | None = None) -> str:
        """One user turn (after a system turn when `system` is given), ending with the assistant's
        generation prompt. A template that has no system role (Gemma) refuses `system`."""
        messages = ([{"role": "system", "content": system}] if system is not None else [])
        return self.render_chat(messages + [{"role": "user", "content": prompt}])


def _read_json(path):
    """A JSON file's contents, or None when it does not exist; ValueError naming it when unreadable."""
    import json

    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
