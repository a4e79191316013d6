"""A response's logprobs as OpenAI writes them: a chat choice's `content` entries and a completion's legacy
object, over the token strings they show."""

from __future__ import annotations

from tandem.protocol import TokenLogprob


class TokenText:
    """Token ids -> the strings logprobs show them as (the token's own decoded text)."""

    def __init__(self, tokenizer, as_ids: bool = False):
        self.tokenizer = tokenizer
        self.as_ids = as_ids  # vLLM's return_tokens_as_token_ids: text that JSON cannot carry still names its token
        self._cache: dict[int, str] = {}

    def __call__(self, token: int) -> str:
        text = self._cache.get(token)
        if text is None:
            if self.tokenizer is None or self.as_ids:
                text = f"token_id:{token}"
            else:
                text = self.tokenizer.decode([token], skip_special_tokens=False)
            self._cache[token] = text
        return text


def chat_logprobs(token_ids: list[int], logprobs: list[TokenLogprob], text: TokenText) -> list[dict]:
    """The `content` entries of a chat choice's logprobs."""
    out = []
    for token, lp in zip(token_ids, logprobs, strict=True):
        s = text(token)
        out.append({
            "token": s, "logprob": lp.logprob, "bytes": list(s.encode()),
            "top_logprobs": [{"token": (t := text(i)), "logprob": v, "bytes": list(t.encode())}
                             for i, v in zip(lp.top_ids, lp.top_logprobs, strict=True)],
        })
    return out


class CompletionLogprobs:
    """A completion choice's legacy logprobs object, built up delta by delta."""

    def __init__(self, text: TokenText):
        self.text = text
        self.offset = 0

    def add(self, token_ids: list[int], logprobs: list[TokenLogprob]) -> dict:
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token, lp in zip(token_ids, logprobs, strict=True):
            s = self.text(token)
            out["tokens"].append(s)
            out["token_logprobs"].append(lp.logprob)
            top: dict[str, float] = {}
            for i, v in zip(lp.top_ids, lp.top_logprobs, strict=True):
                top.setdefault(self.text(i), v)  # two tokens may read the same ("\ufffd"): the likelier one
            top.setdefault(s, lp.logprob)  # the sampled token, as vLLM includes it
            out["top_logprobs"].append(top)
            out["text_offset"].append(self.offset)
            self.offset += len(s)
        return out


def merge_completion_logprobs(parts: list[dict]) -> dict:
    return {key: [x for part in parts for x in part[key]]
            for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
