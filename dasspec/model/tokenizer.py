"""Tokenizer: a thin wrapper over a Hugging Face ``tokenizer.json`` (the format Huginn and Raven ship).

Special ids come from the tokenizer files (``tokenizer_config.json`` / ``special_tokens_map.json`` / known token
names), never from a Raven ``config.json``, which carries Huginn's ids (65504/65505/65509) by mistake.  The model
family named by the folder's ``config.json`` may add stop tokens (``Family.stop_tokens``: Ouro's ``<|im_end|>``,
which ends a ChatML turn although the base files name ``<|endoftext|>`` as EOS).

Chat: ``apply_chat_template(messages)`` renders the checkpoint's Jinja chat template (``chat_template.jinja``, or
``tokenizer_config.json``'s ``chat_template``) as Hugging Face does - a sandboxed environment with ``trim_blocks``
and ``lstrip_blocks``, ``messages``, ``add_generation_prompt`` and the special-token strings (``bos_token``,
``eos_token``, ...), the ``{% generation %}`` tag, ``raise_exception`` and ``tojson``.  A checkpoint without one
gets ``PLAIN_CHAT_TEMPLATE``: BOS, one ``role: content`` line per message, then ``assistant:``.  The rendered
text carries its special tokens, so it is encoded with ``add_special_tokens=False`` (no second BOS).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping, Sequence

from tokenizers import Tokenizer as HFTokenizer

from .chat_template import compile_chat_template
from .families import stop_tokens
from .safetensors_io import CheckpointError, checkpoint_root, open_regular
from .source import read_json, resolve_source

# Token strings that end a document in the families we load, in priority order.
_EOS_NAMES = ("<|end_text|>", "<|end_of_text|>", "<|endoftext|>", "</s>", "<|eos|>")
_EXTRA_STOPS = ("<|end_turn|>", "<|eot_id|>")
_BOS_NAMES = ("<|begin_text|>", "<|begin_of_text|>", "<s>", "<|bos|>")

# The documented fallback for checkpoints that ship no chat template (the bundled model among them).
PLAIN_CHAT_TEMPLATE = ("{{ bos_token }}{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n"
                       "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")


def _token_text(entry) -> str | None:
    if isinstance(entry, dict):
        return entry.get("content")
    return entry if isinstance(entry, str) else None


class Tokenizer:
    """``encode(text) -> list[int]`` (with BOS when the tokenizer's template adds it), ``decode(ids) -> str``."""

    def __init__(self, tok: HFTokenizer, bos_id: int | None, eos_ids: list[int], pad_id: int | None,
                 chat_template: str | None = None, special_tokens: Mapping[str, str] | None = None):
        self._tok = tok
        self.bos_id, self.eos_ids, self.pad_id = bos_id, eos_ids, pad_id
        self.chat_template = chat_template        # the checkpoint's own template; None -> PLAIN_CHAT_TEMPLATE is used
        self._special: frozenset[int] | None = None     # the special added tokens' ids (``is_special``), when asked
        # bos_token / eos_token / ... strings a template may print; by default those of the special ids
        names = {"bos_token": bos_id, "eos_token": eos_ids[0] if eos_ids else None, "pad_token": pad_id}
        self.special_tokens = dict(special_tokens) if special_tokens is not None else {
            k: tok.id_to_token(i) for k, i in names.items() if i is not None and tok.id_to_token(i) is not None}

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def is_special(self, i: int) -> bool:
        """Whether id ``i`` is one of the tokenizer's special added tokens (a control token, never a word)."""
        if self._special is None:
            self._special = frozenset(k for k, t in self._tok.get_added_tokens_decoder().items() if t.special)
        return int(i) in self._special

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    @property
    def backend(self) -> HFTokenizer:
        return self._tok

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                            chat_template: str | None = None, **template_kwargs: Any) -> str:
        """The conversation as prompt text: ``chat_template`` (default: the checkpoint's, else
        ``PLAIN_CHAT_TEMPLATE``) rendered with ``messages`` (dicts with ``role`` and ``content``) and, as Hugging
        Face passes them, any ``template_kwargs`` (a template's own switches: ``enable_thinking=False`` for
        Nanbeige's or Qwen3's).  Encode the result with ``add_special_tokens=False``: the template already placed
        BOS where the model expects it."""
        if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
            raise ValueError(f"messages must be a list of {{'role': ..., 'content': ...}} dicts, got "
                             f"{type(messages).__name__}")
        for i, m in enumerate(messages):
            if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) or "content" not in m:
                raise ValueError(f"messages[{i}] must be a dict with a 'role' string and a 'content', got {m!r}")
        template = chat_template or self.chat_template or PLAIN_CHAT_TEMPLATE
        return compile_chat_template(template).render(
            **{**template_kwargs, **self.special_tokens}, messages=[dict(m) for m in messages],
            add_generation_prompt=add_generation_prompt)


def _read_chat_template(folder: Path, meta: dict) -> str | None:
    """``chat_template.jinja`` (newer transformers) or tokenizer_config.json's ``chat_template``: a string, or a
    list of named templates of which the one named ``default`` is the chat template."""
    path = folder / "chat_template.jinja"
    if os.path.lexists(path):               # (a dangling link is named as missing, not skipped)
        with open_regular(path, path.name, within=checkpoint_root(folder)) as f:
            raw = f.read()
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as err:
            raise CheckpointError(f"{path} is not UTF-8 text: {err}") from None
    template = meta.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) and template else None


def _family_stops(folder: Path, root: Path) -> tuple[str, ...]:
    """The stop tokens the family of the folder's config.json adds (none without a config.json)."""
    path = folder / "config.json"
    if not os.path.lexists(path):
        return ()
    return stop_tokens(read_json(path, within=root).get("model_type"))


def load_tokenizer(source: str | os.PathLike | None = None) -> Tokenizer:
    """Tokenizer of a checkpoint folder (or HF cache repo id); None -> the bundled model's."""
    folder = resolve_source(source)
    root = checkpoint_root(folder)          # no file outside the checkpoint, after symlinks
    path = folder / "tokenizer.json"
    if not os.path.lexists(path):
        raise CheckpointError(f"no tokenizer.json in {folder}")
    with open_regular(path, path.name, within=root) as f:   # a FIFO or a directory is named, never waited on
        raw = f.read()
    try:
        tok = HFTokenizer.from_str(raw.decode("utf-8"))
    except Exception as err:  # tokenizers raises a bare Exception on malformed files
        reason = "not UTF-8 text" if isinstance(err, UnicodeDecodeError) else str(err)[:200]
        raise CheckpointError(f"cannot read {path}: {reason}") from None
    meta: dict = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        p = Path(folder) / name
        if os.path.lexists(p):              # not JSON, not an object, not a regular file: named, not skipped
            meta.update({k: v for k, v in read_json(p, within=root).items() if v is not None})

    def tid(text):
        return tok.token_to_id(text) if text else None

    eos: list[int] = []
    named = tid(_token_text(meta.get("eos_token")))
    if named is not None:
        eos.append(named)
    for name in _EOS_NAMES + _EXTRA_STOPS:
        i = tid(name)
        if i is not None and i not in eos and (not eos or name in _EXTRA_STOPS):
            eos.append(i)
    for name in _family_stops(Path(folder), root):
        i = tid(name)
        if i is not None and i not in eos:
            eos.append(i)
    bos = tid(_token_text(meta.get("bos_token")))
    if bos is None:
        bos = next((tid(n) for n in _BOS_NAMES if tid(n) is not None), None)
    pad = tid(_token_text(meta.get("pad_token")))
    if pad is None:
        pad = tid("<|pad|>")
    specials = {k: _token_text(meta.get(k)) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
    specials = {k: v for k, v in specials.items() if v}
    for key, i in (("bos_token", bos), ("eos_token", eos[0] if eos else None), ("pad_token", pad)):
        if key not in specials and i is not None:
            specials[key] = tok.id_to_token(i)
    return Tokenizer(tok, bos, eos, pad, chat_template=_read_chat_template(Path(folder), meta),
                     special_tokens=specials)
