"""Per-request parameters, shared by the coordinator (no torch) and the engines."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, Field, field_validator

# The number of draft tokens per round. Above 16 the acceptance of a 1-layer head is
# negligible and the verify forward only gets longer.
MAX_DRAFT_TOKENS = 16

# Draft tree nodes (EAGLE-2 dynamic trees): one bit each in the target's tree mask (target_server/paged.py),
# with the root, in an int64.
MAX_TREE_NODES = 62

# Below this a temperature divides the logits into inf/NaN; vLLM treats it as greedy, and so do we.
GREEDY_BELOW_TEMPERATURE = 1e-5

# Stop strings: text that might start one is held back from the stream, so their length bounds the
# delay of every delta; TGI allows 4 of them, we allow more but keep both bounded.
MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 256

# Alternatives per token a request may ask logprobs for (OpenAI's top_logprobs allows 20, as vLLM does).
MAX_LOGPROBS = 20


class SamplingParams(BaseModel):
    """How the target picks tokens. temperature 0 means greedy (argmax); then top-k/top-p are ignored."""

    temperature: float = 0.0
    top_k: int = Field(default=0, description="0 disables top-k")
    top_p: float = Field(default=1.0, description="1.0 disables top-p")
    seed: int | None = Field(None, ge=-(1 << 63), lt=1 << 63)  # the wire's int64: past it was an INTERNAL error
    # logprob of each generated token under the target's distribution, with this many likeliest
    # alternatives (0: the token's own only); None: no logprobs, nothing computed for them
    logprobs: int | None = None
    # vLLM's penalties (sampling_params.py), applied to the logits before temperature at every position the
    # target scores, a verify's drafts included: presence and frequency over the generated tokens before the
    # position, repetition over the prompt's and those (> 1 discourages; a positive logit divided, a
    # negative one multiplied). Neutral: 0, 0, 1.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # after temperature: tokens below min_p times the likeliest token's probability are dropped (0: off)
    min_p: float = 0.0

    @property
    def penalised(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _penalty(cls, v: float, info) -> float:
        if not -2.0 <= v <= 2.0:  # OpenAI's and vLLM's range
            raise ValueError(f"{info.field_name} must be in [-2, 2], got {v}")
        return v

    @field_validator("repetition_penalty")
    @classmethod
    def _repetition(cls, v: float) -> float:
        if not v > 0 or not math.isfinite(v):
            raise ValueError(f"repetition_penalty must be > 0 and finite, got {v}")
        return v

    @field_validator("min_p")
    @classmethod
    def _min_p(cls, v: float) -> float:
        if not 0.0 <= v <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {v}")
        return v

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, v: float) -> float:
        if not math.isfinite(v) or v < 0:
            raise ValueError(f"temperature must be finite and >= 0, got {v}")
        return v

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int) -> int:
        if v < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {v}")
        return v

    @field_validator("top_p")
    @classmethod
    def _top_p(cls, v: float) -> float:
        if not (0.0 < v <= 1.0) or not math.isfinite(v):
            raise ValueError(f"top_p must be in (0, 1], got {v}")
        return v

    @field_validator("logprobs")
    @classmethod
    def _logprobs(cls, v: int | None) -> int | None:
        if v is not None and not 0 <= v <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {v}")
        return v

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE


class TreeParams(BaseModel):
    """An EAGLE-2 dynamic draft tree (draft_server/tree.py): `depth` expansions, each of the `top_k` likeliest
    nodes of the last depth expanded into its `top_k` likeliest children, ranked by cumulative draft
    log-probability; then the best `nodes` of all of them go to the target, verified in one forward.
    Defaults as the EAGLE-3 reference's (ea_model.py: total_token 60, depth 7, top_k 10)."""

    nodes: int = 60
    depth: int = 7
    top_k: int = 10

    @field_validator("nodes", "depth", "top_k")
    @classmethod
    def _in_range(cls, v: int, info) -> int:
        top = MAX_DRAFT_TOKENS if info.field_name == "depth" else MAX_TREE_NODES
        if not 1 <= v <= top:
            raise ValueError(f"tree {info.field_name} must be in [1, {top}], got {v}")
        return v


def parse_tree(text: str) -> TreeParams:
    """`--tree NODES[,DEPTH[,TOP_K]]` -> TreeParams (ValueError naming what is wrong)."""
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"a tree is NODES[,DEPTH[,TOP_K]] (integers), got {text!r}") from None
    if not 1 <= len(values) <= 3:
        raise ValueError(f"a tree is NODES[,DEPTH[,TOP_K]], got {text!r}")
    return TreeParams(**dict(zip(("nodes", "depth", "top_k"), values, strict=False)))


GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")


class GrammarSpec(BaseModel):
    """A structured output: the generated text must match it (tandem/constraint.py). `value`: a JSON schema
    (its JSON text), a regular expression, a JSON list of the choices' strings, or a Lark grammar (a GBNF one
    is converted); empty for json_object (any JSON object)."""

    kind: Literal["json_schema", "json_object", "regex", "choice", "grammar"]
    value: str = ""


class GenerationRequest(BaseModel):
    """One generation, as the round loop sees it: token ids in, token ids out."""

    prompt_ids: list[int]
    max_new_tokens: int = 64
    num_draft_tokens: int = 4
    sampling: SamplingParams = SamplingParams()
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    speculate: bool = True
    # a draft tree instead of a chain of num_draft_tokens (None: a chain); the K policy may still run a
    # round as a chain or target-only where that pays (tandem/policy.py)
    tree: TreeParams | None = None
    grammar: GrammarSpec | None = None  # structured output: every token keeps the text within it
    min_tokens: int = Field(default=0, ge=0)  # no stop id (EOS, stop_token_ids) before this many tokens

    @property
    def constrained(self) -> bool:
        """Whether the round loop masks the target's tokens (tandem/constraint.py)."""
        return self.grammar is not None or self.min_tokens > 0

    @field_validator("prompt_ids")
    @classmethod
    def _prompt(cls, v: list[int]) -> list[int]:
        if not v:
            raise ValueError("the prompt is empty")
        return v

    @field_validator("max_new_tokens")
    @classmethod
    def _max_new(cls, v: int) -> int:
        if v <= 0:
            raise ValueError(f"max_new_tokens must be > 0, got {v}")
        return v

    @field_validator("num_draft_tokens")
    @classmethod
    def _k(cls, v: int) -> int:
        if not 0 <= v <= MAX_DRAFT_TOKENS:
            raise ValueError(f"num_draft_tokens must be in [0, {MAX_DRAFT_TOKENS}], got {v}")
        return v
