"""Chat templates from a model folder, rendered the way transformers' `apply_chat_template` renders them.

Where the template comes from (transformers' order): the folder's `chat_template.jinja`, else the `chat_template`
of `tokenizer_config.json` (a string, or a list of {"name", "template"} entries: the one named "default"). A
folder with neither has no template: `load_chat_template` returns None and the server's chat endpoint answers 400.

How it renders (transformers/utils/chat_template_utils.py): a sandboxed Jinja environment
(ImmutableSandboxedEnvironment, trim_blocks, lstrip_blocks, the loopcontrols extension), the `tojson` filter
without HTML escaping, the globals `raise_exception`, `strftime_now`, `dict` and a `namespace` that refuses
underscore names; messages with their None-valued keys dropped and a reasoning field aliased as
`reasoning_content` / `thinking`; the tokenizer's special tokens (bos_token, eos_token, ...) as variables, and the
caller's keyword arguments (`chat_template_kwargs`, such as enable_thinking) over them. tests/test_chat_template.py
checks the output against transformers itself. `{% generation %}` blocks render their body (no assistant mask).
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from qwen_mtp.errors import ArgumentError, ConfigError

TEMPLATE_FILE = "chat_template.jinja"
CONFIG_FILE = "tokenizer_config.json"
# the special-token attributes a transformers tokenizer hands every template (its special_tokens_map)
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class TemplateRenderError(ArgumentError):
    """The template refused the messages (its raise_exception) or failed on them: the client's input, a 400."""

    def __init__(self, message):
        super().__init__("messages", "messages the model's chat template accepts", message)


def _token_text(value):
    """A special token of tokenizer_config.json: a string, or an AddedToken-like {"content": ...} object."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_config(folder: Path) -> dict:
    file = folder / CONFIG_FILE
    if not file.is_file():
        return {}
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(file, "(the whole file)", "a JSON object", f"unreadable JSON: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(file, "(the whole file)", "a JSON object", type(data).__name__)
    return data


def _template_of(config: dict, file) -> str | None:
    t = config.get("chat_template")
    if t is None or isinstance(t, str):
        return t
    if isinstance(t, list):
        named = {e.get("name"): e.get("template") for e in t if isinstance(e, dict)}
        if isinstance(named.get("default"), str):
            return named["default"]
        if named:
            return None  # only named templates (tool_use, ...): none to use by default
    raise ConfigError(file, "chat_template", "a string or a list of {name, template} entries", type(t).__name__)


def _environment():
    import jinja2
    import jinja2.ext
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        # transformers' {% generation %} ... {% endgeneration %}: renders its body (the assistant mask is not kept)
        tags = frozenset({"generation"})

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    class TemplateDict:
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a namespace attribute may not start with '_': {name!r}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now, dict=TemplateDict(),
                       namespace=TemplateNamespace)
    return env


def _plain(value):
    """What the template may see: JSON types only, rebuilt (transformers' _plain_template_data)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, dict):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    return f"<{type(value).__name__}>"


def _messages(messages) -> list:
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ArgumentError(f"messages[{i}]", "an object with a role and content", type(m).__name__)
        m = {k: v for k, v in m.items() if v is not None}
        reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(_plain(m))
    return out


class ChatTemplate:
    """A compiled chat template and the special tokens it is rendered with. `render(messages,
    add_generation_prompt=..., **kwargs)` -> the prompt text (kwargs: chat_template_kwargs, e.g. enable_thinking)."""

    def __init__(self, source: str, special_tokens: dict | None = None):
        import jinja2

        self.source = source
        self.special_tokens = {k: v for k, v in (special_tokens or {}).items() if isinstance(v, str)}
        try:
            self._template = _environment().from_string(source)
        except jinja2.exceptions.TemplateSyntaxError as e:
            raise ConfigError("chat template", f"line {e.lineno}", "a Jinja template", f"syntax error: {e}") from None

    def render(self, messages, *, add_generation_prompt: bool = False, tools=None, documents=None,
               **kwargs) -> str:
        import jinja2

        if not isinstance(messages, (list, tuple)) or not messages:
            raise ArgumentError("messages", "a non-empty list of messages", repr(messages)[:80])
        variables = {**self.special_tokens, **_plain(kwargs)}
        try:
            return self._template.render(messages=_messages(messages), tools=_plain(tools),
                                         documents=_plain(documents), add_generation_prompt=add_generation_prompt,
                                         **variables)
        except jinja2.exceptions.TemplateError as e:  # raise_exception, a SecurityError, an undefined call ...
            raise TemplateRenderError(str(e)) from None
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
            raise TemplateRenderError(f"{type(e).__name__}: {e}") from None


def load_chat_template(folder) -> ChatTemplate | None:
    """The folder's chat template (chat_template.jinja first, then tokenizer_config.json's chat_template) with its
    special tokens, or None when it has none."""
    folder = Path(folder)
    config = _read_config(folder)
    file = folder / TEMPLATE_FILE
    source = file.read_text(encoding="utf-8") if file.is_file() else _template_of(config, folder / CONFIG_FILE)
    if source is None:
        return None
    special = {k: _token_text(config.get(k)) for k in SPECIAL_TOKENS}
    return ChatTemplate(source, special)
