"""Chat templates (``Tokenizer.apply_chat_template``): the checkpoint's Jinja template rendered as Hugging Face
renders it (sandboxed, trim_blocks + lstrip_blocks, bos/eos strings, ``{% generation %}``), from
tokenizer_config.json or chat_template.jinja; the documented plain template for checkpoints without one; the real
Huginn-0125 template on a copy of its tokenizer files (skipped when they are not at hand)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import jinja2
import pytest

import dasspec
from dasspec.model.tokenizer import PLAIN_CHAT_TEMPLATE
from reference_impl import write_tokenizer

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]

# A template that leans on what Hugging Face's environment provides: trim_blocks / lstrip_blocks (the newline
# after a block tag and the indentation before one vanish), bos_token / eos_token, the generation tag,
# raise_exception and tojson.
TEMPLATE = """{{ bos_token }}{% for m in messages %}
    {% if m['role'] not in ['system', 'user', 'assistant'] %}
        {{ raise_exception('unknown role ' + m['role']) }}
    {% endif %}
<|begin_header|>{{ m['role'] }}<|end_header|>
{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}{% endgeneration %}{% else %}{{ m['content'] | tojson }}{% endif %}
<|end_turn|>
{% endfor %}
{% if add_generation_prompt %}<|begin_header|>assistant<|end_header|>
{% else %}{{ eos_token }}{% endif %}"""


def tokenizer_folder(tmp_path: Path, config_edits: dict | None = None, jinja_file: str | None = None) -> Path:
    folder = tmp_path / "tok"
    folder.mkdir()
    for name, text in write_tokenizer("huginn").items():
        if name == "tokenizer_config.json":
            text = json.dumps({**json.loads(text), **(config_edits or {})})
        (folder / name).write_text(text)
    if jinja_file is not None:
        (folder / "chat_template.jinja").write_text(jinja_file)
    return folder


def test_plain_template_for_checkpoints_without_one():
    tok = dasspec.load_tokenizer()                       # the bundled model ships no template
    assert tok.chat_template is None
    text = tok.apply_chat_template(CHAT)
    assert text == "<|begin_text|>system: Be brief.\nuser: Hi\nassistant:"
    assert tok.apply_chat_template(CHAT, add_generation_prompt=False) == "<|begin_text|>system: Be brief.\nuser: Hi\n"
    ids = tok.encode(text, add_special_tokens=False)     # the template placed BOS: exactly one
    assert ids[0] == tok.bos_id and ids.count(tok.bos_id) == 1
    assert tok.apply_chat_template(CHAT, chat_template=PLAIN_CHAT_TEMPLATE) == text


def test_checkpoint_template_from_tokenizer_config(tmp_path):
    tok = dasspec.load_tokenizer(tokenizer_folder(tmp_path, {"chat_template": TEMPLATE}))
    assert tok.chat_template == TEMPLATE
    chat = CHAT + [{"role": "assistant", "content": "Hello."}, {"role": "user", "content": 'say "x"'}]
    assert tok.apply_chat_template(chat) == (
        '<|begin_text|><|begin_header|>system<|end_header|>\n"Be brief."<|end_turn|>\n'
        '<|begin_header|>user<|end_header|>\n"Hi"<|end_turn|>\n'
        '<|begin_header|>assistant<|end_header|>\nHello.<|end_turn|>\n'
        '<|begin_header|>user<|end_header|>\n"say \\"x\\""<|end_turn|>\n'
        '<|begin_header|>assistant<|end_header|>\n')
    assert tok.apply_chat_template(CHAT, add_generation_prompt=False).endswith("<|end_turn|>\n<|end_text|>")
    with pytest.raises(jinja2.TemplateError, match="unknown role tool"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])


def test_template_file_and_named_templates(tmp_path):
    named = [{"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": "{{ messages[0]['content'] }}!"}]
    tok = dasspec.load_tokenizer(tokenizer_folder(tmp_path, {"chat_template": named}))
    assert tok.apply_chat_template(CHAT) == "Be brief.!"
    shutil.rmtree(tmp_path / "tok")
    tok = dasspec.load_tokenizer(tokenizer_folder(tmp_path, {"chat_template": "CONFIG"}, jinja_file="FILE {{ eos_token }}"))
    assert tok.apply_chat_template(CHAT) == "FILE <|end_text|>"      # chat_template.jinja wins, as in transformers


def test_templates_run_sandboxed(tmp_path):
    tok = dasspec.load_tokenizer(tokenizer_folder(tmp_path))
    with pytest.raises(jinja2.exceptions.SecurityError):
        tok.apply_chat_template(CHAT, chat_template="{{ messages.append(1) }}")        # immutable
    with pytest.raises(jinja2.exceptions.SecurityError):
        tok.apply_chat_template(CHAT, chat_template="{{ messages.__class__.__base__.__subclasses__() }}")
    with pytest.raises(ValueError, match=r"messages\[0\]"):
        tok.apply_chat_template([{"content": "no role"}])


def huginn_tokenizer_files() -> Path:
    folder = Path(os.environ.get("DASSPEC_HUGINN", Path(__file__).resolve().parents[2] / "shared" / "checkpoints"
                                 / "huginn-0125"))
    names = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
    if not all((folder / n).exists() for n in names):
        pytest.skip(f"Huginn-0125 tokenizer files not found in {folder} (set DASSPEC_HUGINN to the checkpoint folder)")
    return folder


def test_real_huginn_template(tmp_path):
    src = huginn_tokenizer_files()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(src / name, tmp_path / name)
    tok = dasspec.load_tokenizer(tmp_path)
    assert tok.chat_template is not None and "{% generation %}" in tok.chat_template
    # Huginn's model card format: BOS once, <|begin_header|>role<|end_header|>\n\n, content trimmed, <|end_turn|>,
    # the assistant turn under the name Huginn
    assert tok.apply_chat_template([{"role": "system", "content": " Be brief. "}, {"role": "user", "content": "Hi"}]) \
        == ("<|begin_text|><|begin_header|>system<|end_header|>\n\nBe brief.<|end_turn|>"
            "<|begin_header|>user<|end_header|>\n\nHi<|end_turn|><|begin_header|>Huginn<|end_header|>\n\n")
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]
    assert tok.apply_chat_template(chat, add_generation_prompt=False) == (
        "<|begin_text|><|begin_header|>user<|end_header|>\n\nHi<|end_turn|>"
        "<|begin_header|>Huginn<|end_header|>\n\nYo<|end_turn|><|end_text|>")
    ids = tok.encode(tok.apply_chat_template(chat[:1]), add_special_tokens=False)
    assert ids[:2] == [tok.bos_id, tok.token_to_id("<|begin_header|>")] and ids.count(tok.bos_id) == 1


def test_a_template_limit_does_not_count_the_render_process_start(tmp_path, monkeypatch):
    """The render process's start (an interpreter and jinja2, slow on a loaded machine; again after every template
    killed for spinning) is waited for under a bound of its own: a template's time limit counts its rendering only,
    so one user's spinning template cannot make the next user's plain one time out."""
    import sys

    from dasspec.model.chat_template import TemplateSandbox

    slow = tmp_path / "slow-python"
    slow.write_text(f"#!/bin/sh\nsleep 1\nexec {sys.executable} \"$@\"\n")
    slow.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(slow))
    box = TemplateSandbox(0.5, 10_000)
    try:
        for _ in range(2):                       # the first start, then a start after a killed child
            text = box.render("{% for m in messages %}{{ m['content'] }}{% endfor %}", CHAT, False, {})
            assert text == "Be brief.Hi"
            box._kill()
    finally:
        box.close()
