"""Chat templates (qwen_mtp/serving/chat_template.py) against transformers' apply_chat_template, the oracle: a
Qwen3-style template (think blocks, enable_thinking, a namespace, loop variables, tojson, raise_exception, the
tokenizer's special tokens as variables) in a test folder's tokenizer_config.json, rendered over system / user /
assistant / multi-turn lists, with and without the generation prompt and enable_thinking; where the template is
looked for; the shipped model's own template; a folder without one."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("jinja2")
transformers = pytest.importorskip("transformers")

from qwen_mtp.errors import ConfigError
from qwen_mtp.loading.folder import default_model_path
from qwen_mtp.serving.chat_template import (
    ChatTemplate,
    TemplateRenderError,
    load_chat_template,
)

# modelled on the Qwen3 family's template (written here, not copied): the last user turn decides which assistant
# turns keep their reasoning; enable_thinking=false closes an empty think block in the generation prompt
TEMPLATE = """\
{%- set ns = namespace(last_user=-1) -%}
{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}
{%- for message in messages %}
{%- if message.role not in ['system', 'user', 'assistant'] %}
{{- raise_exception('unknown role: ' ~ message.role) }}
{%- endif %}
{%- if message.role == 'assistant' and message.reasoning_content is defined and loop.index0 > ns.last_user %}
{{- '<|im_start|>assistant\\n<think>\\n' + message.reasoning_content | trim + '\\n</think>\\n\\n' + message.content | trim + '<|im_end|>\\n' }}
{%- else %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}
{{- '<think>\\n\\n</think>\\n\\n' }}
{%- endif %}
{%- endif %}
{% if meta is defined %}
  {{ meta | tojson }}{{ eos_token }}
{% endif %}
"""

CHATS = {
    "user": [{"role": "user", "content": "Write a function that adds two numbers."}],
    "system_user": [{"role": "system", "content": "You write Python."},
                    {"role": "user", "content": "Sort a list, é and ü included."}],
    "multi_turn": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
                   {"role": "assistant", "content": "hello", "reasoning_content": "greet back"},
                   {"role": "user", "content": "add 2 and 3"},
                   {"role": "assistant", "content": " 5 ", "reasoning_content": " 2 + 3 "}],
    "assistant_last": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y", "name": None}],
}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    d = tmp_path_factory.mktemp("chat_folder")
    (d / "tokenizer.json").write_bytes((default_model_path() / "tokenizer.json").read_bytes())
    (d / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": TEMPLATE, "eos_token": "<|endoftext|>",
        "bos_token": {"content": "<|endoftext|>", "special": True}, "tokenizer_class": "PreTrainedTokenizerFast"}))
    return d


@pytest.fixture(scope="module")
def oracle(folder):
    from tokenizers import Tokenizer

    return transformers.PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_file(str(folder / "tokenizer.json")),
                                                eos_token="<|endoftext|>", bos_token="<|endoftext|>",
                                                chat_template=TEMPLATE)


@pytest.mark.parametrize("chat", sorted(CHATS))
@pytest.mark.parametrize("gen", [False, True])
@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}, {"enable_thinking": True},
                                    {"meta": {"a": "<b>&", "n": [1, 2]}}])
def test_renders_as_transformers(folder, oracle, chat, gen, kwargs):
    ours = load_chat_template(folder).render(CHATS[chat], add_generation_prompt=gen, **kwargs)
    theirs = oracle.apply_chat_template(CHATS[chat], add_generation_prompt=gen, tokenize=False, **kwargs)
    assert ours == theirs


def test_control_a_different_rendering_fails(folder, oracle):
    """The comparison can fail: jinja's own defaults (no trim_blocks / lstrip_blocks, an HTML-escaping tojson)
    render the same template and variables differently."""
    import jinja2.sandbox

    plain = jinja2.sandbox.ImmutableSandboxedEnvironment().from_string(TEMPLATE)
    chat, meta = CHATS["multi_turn"], {"a": "<b>&"}
    theirs = oracle.apply_chat_template(chat, add_generation_prompt=True, tokenize=False, meta=meta)
    assert plain.render(messages=chat, add_generation_prompt=True, meta=meta, eos_token="<|endoftext|>") != theirs
    assert load_chat_template(folder).render(chat, add_generation_prompt=True, meta=meta) == theirs


def test_where_the_template_comes_from(tmp_path):
    assert load_chat_template(tmp_path) is None  # neither file: no template, the server answers 400
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": [
        {"name": "tool_use", "template": "T"}, {"name": "default", "template": "D{{ messages | length }}"}]}))
    assert load_chat_template(tmp_path).render([{"role": "user", "content": "x"}]) == "D1"
    (tmp_path / "chat_template.jinja").write_text("J{{ eos_token }}")  # the .jinja file wins, as in transformers
    assert load_chat_template(tmp_path).render([{"role": "user", "content": "x"}]) == "J"
    (tmp_path / "chat_template.jinja").write_text("{% if %}")
    with pytest.raises(ConfigError, match="syntax"):
        load_chat_template(tmp_path)


def test_template_refusals_and_the_sandbox():
    t = ChatTemplate(TEMPLATE)
    with pytest.raises(TemplateRenderError, match="unknown role: tool"):
        t.render([{"role": "tool", "content": "x"}])
    with pytest.raises(TemplateRenderError):  # the sandbox: no attribute walk to Python internals
        ChatTemplate("{{ messages.__class__.__mro__ }}").render([{"role": "user", "content": "x"}])
    with pytest.raises(TemplateRenderError):
        ChatTemplate("{% set ns = namespace(_x=1) %}").render([{"role": "user", "content": "x"}])
    assert ChatTemplate("{{ strftime_now('%Y') | length }}").render([{"role": "user", "content": "x"}]) == "4"


def test_shipped_template():
    t = load_chat_template(default_model_path())
    chat = [{"role": "system", "content": "String helpers."}, {"role": "user", "content": "Reverse a string.\nShort."},
            {"role": "assistant", "content": "def reverse(s):\n    return s[::-1]\n"},
            {"role": "user", "content": [{"type": "text", "text": "Count vowels."}]}]
    assert t.render(chat, add_generation_prompt=True) == ('"""String helpers."""\n\n# Reverse a string.\n# Short.\n'
                                                          'def reverse(s):\n    return s[::-1]\n\n# Count vowels.\n')
    with pytest.raises(TemplateRenderError, match="roles system, user and assistant"):
        t.render([{"role": "tool", "content": "x"}])
