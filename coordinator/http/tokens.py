"""vLLM's token routes, as its OpenAI server has them:

    POST /tokenize     {"prompt": ...} or {"messages": [...]} (rendered as /v1/chat/completions renders them)
                       -> {"count", "max_model_len", "tokens", "token_strs"}
    POST /detokenize   {"tokens": [...]} -> {"prompt"}
    GET  /version      {"version"}

The same tokenizer as the generation endpoints (the target's, from TargetInfo), so a prompt's count here is
its usage.prompt_tokens there.
"""

from __future__ import annotations

import importlib.metadata
from typing import ClassVar

from pydantic import BaseModel, ConfigDict, model_validator

from coordinator.http import fields
from coordinator.http.protocol import Conversation, bad_request
from coordinator.monitor import Pair

# A chat /tokenize renders as a chat request does, so what that refuses this does too.
CHAT_REFUSED = {name: fields.CHAT[name] for name in ("chat_template", "mm_processor_kwargs")}


# Fill-in-the-middle tokens (prefix, suffix, middle), as the model families that have them spell them; the prompt
# is written prefix-suffix-middle (PSM), the order they were trained with.
FIM_TOKENS = [("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),  # Qwen2.5-Coder, SmolLM, StarCoder2
              ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),  # StarCoder
              ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),  # DeepSeek-Coder
              ("▁<PRE>", "▁<SUF>", "▁<MID>")]  # Code Llama


def fim_prompt(tokenizer, prompt: str, suffix: str) -> list[int]:
    """`suffix` (completions): the prompt's ids for the middle between `prompt` and `suffix`; a 400 naming
    `suffix` when the tokenizer has no fill-in-the-middle tokens."""
    for names in FIM_TOKENS:
        ids = [tokenizer.token_to_id(name) for name in names] if tokenizer is not None else [None]
        if None not in ids:
            pre, suf, mid = ids
            encode = lambda text: tokenizer.encode(text, add_special_tokens=False).ids
            return [pre, *encode(prompt), suf, *encode(suffix), mid]
    raise bad_request("`suffix`: the model's tokenizer has no fill-in-the-middle tokens "
                      f"({', '.join(n[0] for n in FIM_TOKENS)} and the like)", "suffix", "unsupported_value")


def tokenize(pair: Pair, text: str, special: bool = True) -> list[int]:
    if pair.tokenizer is None:
        raise bad_request("the target has no tokenizer: send the prompt as token ids", "prompt")
    return pair.tokenizer.encode(text, add_special_tokens=special).ids


class _Prepared(BaseModel):
    model_config = ConfigDict(extra="ignore")
    REFUSED: ClassVar[dict[str, fields.Refused]] = {}

    @model_validator(mode="before")
    @classmethod
    def _prepare(cls, data):
        return fields.prepare(data, cls.REFUSED) if isinstance(data, dict) else data


class TokenizeCompletionRequest(_Prepared):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(Conversation, _Prepared):
    REFUSED: ClassVar[dict[str, fields.Refused]] = CHAT_REFUSED

    model: str | None = None
    return_token_strs: bool = False


class DetokenizeRequest(_Prepared):
    model: str | None = None
    tokens: list[int]


def version() -> dict:
    return {"version": importlib.metadata.version("tandem")}


def tokenize_answer(front, body: dict) -> dict:
    """`front`: the app's Front (its model, its chat rendering)."""
    params = (TokenizeChatRequest if "messages" in body else TokenizeCompletionRequest).model_validate(body)
    front.check_model(params.model)
    pair = front.generations.pair()
    if isinstance(params, TokenizeChatRequest):
        ids = front.render(pair, params)
    else:
        ids = tokenize(pair, params.prompt, params.add_special_tokens)
    strs = [pair.tokenizer.id_to_token(i) for i in ids] if params.return_token_strs else None
    return {"count": len(ids), "max_model_len": pair.target_info.max_context, "tokens": ids, "token_strs": strs}


def detokenize_answer(front, body: dict) -> dict:
    params = DetokenizeRequest.model_validate(body)
    front.check_model(params.model)
    pair = front.generations.pair()
    if pair.tokenizer is None:
        raise bad_request("the target has no tokenizer", "tokens")
    vocab = pair.target_info.vocab_size
    bad = [t for t in params.tokens if not 0 <= t < vocab]
    if bad:
        raise bad_request(f"tokens has token ids outside the vocabulary [0, {vocab}): {bad[:5]}", "tokens")
    return {"prompt": pair.tokenizer.decode(params.tokens, skip_special_tokens=False)}
