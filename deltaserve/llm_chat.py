"""LLM.chat's prompts: each conversation rendered with the model's chat template (or one given
for the call) and vLLM's LLM.chat options (add_generation_prompt, continue_final_message, tools,
chat_template_kwargs) as transformers' apply_chat_template renders them, then tokenized without
special tokens (the template writes its own). Every refusal is a ParamError naming the option.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from engine_common.model_files.model_dir import load_json
from engine_common.request.params import ParamError
from engine_common.text.chat_template import (ChatMessage, ChatTemplate, ChatTemplateError,
                                              encode_chat, special_tokens_of)
from engine_common.text.tokenizer import Tokenizer

# What the template gets from the call itself: chat_template_kwargs may not say it again.
_RESERVED = ("messages", "add_generation_prompt", "tools", "documents")
# Appended to the final message to find where its content ends once rendered (transformers
# does the same); the prompt is cut there, so the model goes on with that message.
_CONTINUE_TAG = "DELTASERVE_CONTINUE_HERE "


@dataclass(frozen=True)
class ChatOptions:
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list | None = None
    template_kwargs: Mapping | None = None

    def check(self) -> None:
        for name in ("add_generation_prompt", "continue_final_message"):
            if not isinstance(getattr(self, name), bool):
                raise ParamError(name, getattr(self, name), "True or False")
        if self.add_generation_prompt and self.continue_final_message:
            raise ParamError("continue_final_message", True, "used with add_generation_prompt="
                             "False (it goes on with the final message instead of opening a "
                             "new one)")
        if self.tools is not None and not (
                isinstance(self.tools, Sequence) and not isinstance(self.tools, (str, bytes))
                and all(isinstance(t, Mapping) for t in self.tools)):
            raise ParamError("tools", self.tools, "None or a list of dicts (JSON schemas)")
        kwargs = self.template_kwargs
        if kwargs is None:
            return
        if not isinstance(kwargs, Mapping):
            raise ParamError("chat_template_kwargs", kwargs, "None or a dict")
        for key in kwargs:
            if not isinstance(key, str) or key in _RESERVED:
                raise ParamError(f"chat_template_kwargs[{key!r}]", kwargs[key],
                                 f"under a string key other than {', '.join(_RESERVED)} (those "
                                 "come from the call)")


def call_template(model_template: ChatTemplate | None, source, model_dir: str
                  ) -> ChatTemplate | None:
    """The template of one chat() call: `source` (Jinja text, as vLLM's chat_template) with the
    model's special tokens, else the model's own."""
    if source is None:
        return model_template
    if not isinstance(source, str) or not source.strip():
        raise ParamError("chat_template", source, "None or the text of a Jinja chat template")
    if model_template is not None:
        special = model_template.special_tokens
    else:
        config = Path(model_dir) / "tokenizer_config.json"
        special = special_tokens_of(load_json(config)) if config.is_file() else {}
    try:
        return ChatTemplate(source, special)
    except ValueError as e:     # not valid Jinja (ModelDirError, for a model's own file)
        raise ParamError("chat_template", source, f"a valid Jinja template ({e})") from None


def chat_prompt_ids(tokenizer: Tokenizer, template: ChatTemplate | None, conv: list,
                    options: ChatOptions, model_name: str) -> list[int]:
    if template is None or not conv:
        return encode_chat(tokenizer, template, conv, model_name)    # its refusal, by name
    messages = list(conv)
    if options.continue_final_message:
        messages[-1] = _tagged(messages[-1])
    try:
        text = template.render(messages, options.add_generation_prompt, tools=options.tools,
                               extra=dict(options.template_kwargs or {}))
    except ChatTemplateError as e:
        raise ParamError("messages", f"{len(conv)} messages",
                         f"accepted by the chat template ({e})") from None
    if options.continue_final_message:
        text = _cut_at_tag(text)
    return tokenizer.encode(text, add_special_tokens=False)


def _tagged(message) -> dict:
    plain = ({"role": message.role, "content": message.content}
             if isinstance(message, ChatMessage) else dict(message))
    if not isinstance(plain.get("content"), str):
        raise ParamError("messages (the final message's content)", plain.get("content"),
                         "text to continue (continue_final_message)")
    return {**plain, "content": plain["content"] + _CONTINUE_TAG}


def _cut_at_tag(text: str) -> str:
    """The rendered text up to the end of the final message's content. A template that trims
    the content keeps the tag without its space: then trailing space goes too."""
    at = text.rfind(_CONTINUE_TAG.strip())
    if at < 0:
        raise ParamError("continue_final_message", True, "used with a chat template that "
                         "writes the final message's content (this one leaves it out)")
    return text[:at] if text.startswith(_CONTINUE_TAG, at) else text[:at].rstrip()
