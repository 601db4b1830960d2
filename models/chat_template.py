"""Hugging Face chat templates, rendered with jinja2 the way transformers renders them.

transformers (5.x, `utils/chat_template_utils.py`) compiles a template in an
`ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)` with the `loopcontrols`
extension and a `{% generation %}` block tag, replaces the `tojson` filter (no HTML escaping), adds
the globals `raise_exception`, `strftime_now`, `dict` and `namespace`, drops message keys whose
value is None, and renders with `messages`, `tools`, `documents`, `add_generation_prompt` and the
tokenizer's named special tokens (`bos_token`, `eos_token`, `unk_token`, `sep_token`, `pad_token`,
`cls_token`, `mask_token`) as strings. This module does the same; tests/test_hf_models.py checks
the output against transformers' `apply_chat_template` on recorded renderings.

A template's `raise_exception("...")` (e.g. Gemma's "System role not supported") becomes a
`ChatTemplateError` (a ValueError) carrying the template's message.
"""

import datetime
import functools
import json

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                       "mask_token")


class ChatTemplateError(ValueError):
    """The chat template refused the conversation (its raise_exception) or could not be parsed."""


@functools.lru_cache(maxsize=16)
def compile_template(source: str):
    """The jinja2 Template of a chat template string (cached), in transformers' environment."""
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """`{% generation %}...{% endgeneration %}` marks assistant text for training masks;
        when rendering it is its body."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise ChatTemplateError(f"the chat template refused the conversation: {message}")

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    env.globals["dict"] = dict
    env.globals["namespace"] = jinja2.utils.Namespace
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"the chat template is not valid Jinja: {e}") from e


def render(source: str, messages, *, add_generation_prompt: bool = True, special_tokens=None, tools=None,
           **kwargs) -> str:
    """Renders `messages` with the chat template `source`, as transformers' apply_chat_template(
    tokenize=False) does.

    Args:
      source: the template (tokenizer_config.json's "chat_template" or chat_template.jinja).
      messages: a list of {"role": ..., "content": ...} dicts.
      add_generation_prompt: end with the header of an assistant turn.
      special_tokens: {"bos_token": "<bos>", ...}: the tokenizer's named special tokens.
      tools: OpenAI-style tool definitions ([{"type": "function", "function": {...}}]) for templates
        that render them (transformers' `tools`), or None.
      **kwargs: further template variables (they override special tokens of the same name).

    Returns:
      The rendered text.

    Raises:
      ChatTemplateError: the template's raise_exception was called, or the template is invalid.
    """
    import jinja2

    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError(f"messages must be a non-empty list of dicts; got {messages!r}")
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ValueError(f"each message must be a dict with a string 'role'; got {m!r}")
    chat = [{k: v for k, v in m.items() if v is not None} for m in messages]
    variables = {**(special_tokens or {}), **kwargs}
    try:
        return compile_template(source).render(messages=chat, tools=tools or None, documents=None,
                                               add_generation_prompt=add_generation_prompt, **variables)
    except ChatTemplateError:
        raise
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"the chat template failed: {type(e).__name__}: {e}") from e
