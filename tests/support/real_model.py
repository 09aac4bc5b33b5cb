"""The real default model (SmolLM2-135M-Instruct) in tests: chats to ask it and transformers'
reference prompt ids for them (apply_chat_template on the converted directory)."""
from __future__ import annotations

from functools import lru_cache

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
# transformers' greedy answer on the same weights, ending with <|im_end|> (id 2)
FRANCE_ANSWER_IDS = [504, 3575, 282, 4649, 314, 7042, 30, 2]
FRANCE_ANSWER = "The capital of France is Paris."

CHATS = [
    FRANCE,
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "Name three primary colors."}],
    [{"role": "user", "content": "Hi!"},
     {"role": "assistant", "content": "Hello! How can I help you today?"},
     {"role": "user", "content": "Write one sentence about the sea, with 2 numbers in it."}],
]


@lru_cache(maxsize=4)
def _tokenizer(model_dir: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def hf_chat_ids(model_dir: str, chat: list[dict], add_generation_prompt: bool = True,
                **kwargs) -> list[int]:
    """transformers' prompt ids of `chat`, with the generation prompt unless told; `kwargs`
    as apply_chat_template's (continue_final_message, chat_template, tools, template
    variables)."""
    ids = _tokenizer(model_dir).apply_chat_template(
        chat, add_generation_prompt=add_generation_prompt, return_dict=False, **kwargs)
    return list(ids)
