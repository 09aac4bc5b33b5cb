"""Chat messages -> prompt text with the model's chat template, as transformers'
`tokenizer.apply_chat_template(messages, add_generation_prompt=..., tokenize=False)` renders it.

Templates come with models, so they are untrusted code: they run in Jinja2's
ImmutableSandboxedEnvironment configured exactly as transformers configures it
(utils/chat_template_utils.py): trim_blocks, lstrip_blocks, the loopcontrols extension, a
`tojson` that does not escape HTML, `raise_exception`, `strftime_now`, and namespaces that refuse
underscore attributes. The template sees `messages`, `add_generation_prompt`, `tools` and
`documents` (None) and the named special tokens (bos_token, eos_token, ...).

Where a model directory keeps its template (first found wins): chat_template.jinja, then
tokenizer_config.json's `chat_template` (a string, or a list of {name, template} whose "default"
entry is used); a GGUF file keeps it in `tokenizer.chat_template`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from pathlib import Path

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from engine_common.model_files.gguf_file import GGUFError, GGUFFile, find_gguf
from engine_common.model_files.gguf_tokenizer import tokenizer_config_from_gguf
from engine_common.model_files.model_dir import ModelDirError, load_json
from engine_common.request.params import ParamError
from engine_common.text.tokenizer import Tokenizer

TEMPLATE_FILE = "chat_template.jinja"
# The named special tokens transformers hands to templates (special_tokens_map).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                       "cls_token", "mask_token")


class ChatTemplateError(ValueError):
    """The template failed to render these messages (it raised, or is not valid Jinja)."""


@dataclass(frozen=True)
class ChatMessage:
    """One turn of a conversation. `role` is what the template expects: system, user, assistant."""

    role: str
    content: str


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


class _TemplateDict:
    """`dict(...)` inside templates, without exposing the dict type itself."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """`namespace(...)` that refuses underscore-prefixed attribute names."""

    def __init__(*args, **kwargs):   # noqa: N805 -- jinja's own signature trick
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed attributes on a namespace "
                f"({name!r})")


@lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env.from_string(source)


class ChatTemplate:
    """A compiled chat template and the special tokens it may refer to; `tool_use`: the
    template a chat with tools renders with instead (Command-R's named "tool_use" one)."""

    def __init__(self, source: str, special_tokens: dict[str, str] | None = None,
                 tool_use: str | None = None):
        self.source = source
        self.special_tokens = dict(special_tokens or {})
        self._template = _compile_model_template(source, "chat template")
        self._tool_use = _compile_model_template(tool_use, "tool_use chat template") \
            if tool_use else None

    def render(self, messages: list[ChatMessage | dict],
               add_generation_prompt: bool = True, *, tools: list | None = None,
               extra: dict | None = None) -> str:
        """The prompt text of `messages`; ChatTemplateError when the template refuses them.
        `extra`: more variables for the template (transformers' apply_chat_template kwargs),
        over the special tokens."""
        plain = [_plain_message(m) for m in messages]
        # transformers' get_chat_template: tools pick the "tool_use" template when there is one
        template = self._tool_use if tools is not None and self._tool_use else self._template
        try:
            return template.render(messages=plain, tools=tools, documents=None,
                                         add_generation_prompt=add_generation_prompt,
                                         **{**self.special_tokens, **(extra or {})})
        except jinja2.TemplateError as e:    # incl. raise_exception and sandbox SecurityError
            raise ChatTemplateError(f"the chat template failed: {e}") from None

    @classmethod
    def from_tokenizer_config(cls, source: str | list | None,
                              tokenizer_config: dict) -> "ChatTemplate | None":
        """The template `source` (a string, or named templates) with tokenizer_config.json's
        special tokens; None when there is no template. Named templates
        ([{"name": ..., "template": ...}]: Command-R's) give "default", and "tool_use" for chats
        with tools."""
        tool_use = None
        if isinstance(source, list):
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source, tool_use = named.get("default"), named.get("tool_use")
        if not source:
            return None
        return cls(source, special_tokens_of(tokenizer_config), tool_use)


def _compile_model_template(source: str, what: str) -> jinja2.Template:
    """A model's template compiled; ModelDirError when it is not valid Jinja (the model's files
    are broken: refused at load)."""
    try:
        return _compile(source)
    except jinja2.TemplateError as e:
        raise ModelDirError(f"the {what} is not valid Jinja: {e}") from None


def _plain_message(message: ChatMessage | dict) -> dict:
    """A message as the plain dict templates index (`message['role']`); None fields dropped,
    as transformers drops them."""
    if isinstance(message, ChatMessage):
        return {"role": message.role, "content": message.content}
    return {str(k): v for k, v in dict(message).items() if v is not None}


def special_tokens_of(tokenizer_config: dict) -> dict[str, str]:
    """tokenizer_config.json's named special tokens as strings (written as a string or as
    {"content": ...})."""
    out = {}
    for name in SPECIAL_TOKEN_NAMES:
        value = tokenizer_config.get(name)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            out[name] = value
    return out


def load_chat_template(model_dir: str | Path, override: str | None = None
                       ) -> ChatTemplate | None:
    """A model directory's (or GGUF file's) chat template, or None when it has none;
    `override`: a template file used instead (with the model's special tokens)."""
    path = Path(model_dir)
    try:
        gguf_path = find_gguf(path)
        if gguf_path is not None:
            config = tokenizer_config_from_gguf(GGUFFile.open(gguf_path))
            source = _read_template(Path(override)) if override else config.get("chat_template")
            return ChatTemplate.from_tokenizer_config(source, config)
    except GGUFError as e:
        raise ModelDirError(str(e)) from None
    cfg_path = path / "tokenizer_config.json"
    config = load_json(cfg_path) if cfg_path.is_file() else {}
    jinja_path = Path(override) if override else path / TEMPLATE_FILE
    if jinja_path.is_file():
        return ChatTemplate.from_tokenizer_config(_read_template(jinja_path), config)
    return ChatTemplate.from_tokenizer_config(config.get("chat_template"), config)


def _read_template(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ModelDirError(f"{path} could not be read: {e}") from None


def encode_chat(tokenizer: Tokenizer, template: ChatTemplate | None,
                messages: list[ChatMessage | dict] | tuple, model_name: str = "the model",
                add_generation_prompt: bool = True, max_chars: int | None = None) -> list[int]:
    """Prompt ids of a chat: rendered with `template`, then tokenized without adding special
    tokens (the template writes its own), as apply_chat_template(tokenize=True) does.
    ParamError on the `messages` field when the model has no template, the template refuses
    the messages, or the rendered text is longer than `max_chars` (checked before tokenizing:
    the template's markup per message is not in the messages' own length, so many tiny
    messages render to many times their characters)."""
    if not messages:
        raise ParamError("messages", [], "at least one message")
    if template is None:
        raise ParamError("messages", f"{len(messages)} messages",
                         f"sent to a model with a chat template: {model_name} has none (no "
                         f"{TEMPLATE_FILE}, no chat_template in tokenizer_config.json or in "
                         "the GGUF metadata); send text or token_ids instead")
    try:
        text = template.render(list(messages), add_generation_prompt)
    except ChatTemplateError as e:
        raise ParamError("messages", f"{len(messages)} messages",
                         f"accepted by the model's chat template ({e})") from None
    if max_chars is not None and len(text) > max_chars:
        raise ParamError("messages", f"{len(messages)} messages, {len(text)} characters "
                         "rendered", f"at most {max_chars} characters once rendered with the "
                         "chat template (a longer prompt cannot fit max_model_len)")
    return tokenizer.encode(text, add_special_tokens=False)
