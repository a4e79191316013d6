"""The model's default sampling: the temperature, top_p, top_k, repetition_penalty and min_p of the target
checkpoint's generation_config.json (TargetInfo.generation_config), for the requests that leave them unset,
as vLLM applies them (its --generation-config auto). Without them, OpenAI's defaults: temperature 1, top_p 1,
no top-k, no penalty. No torch here."""

from __future__ import annotations

import json
import math
from functools import lru_cache

from tandem.params import SamplingParams

OPENAI_DEFAULTS: dict[str, float | int] = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "repetition_penalty": 1.0,
                                           "min_p": 0.0}
# The gRPC API's, a GenerateRequest without SamplingParams: greedy.
GREEDY: dict[str, float | int] = {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "repetition_penalty": 1.0,
                                  "min_p": 0.0}


def _valid(name: str, value) -> bool:
    """A value SamplingParams takes: a checkpoint's odd value must not fail requests that never sent it."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return False
    if name == "temperature":
        return value >= 0
    if name == "top_p":
        return 0 < value <= 1
    if name == "repetition_penalty":
        return value > 0
    if name == "min_p":
        return 0 <= value <= 1
    return value == int(value) and value >= -1  # top_k; -1 disables it, as 0 does


@lru_cache(maxsize=8)
def checkpoint_sampling(generation_config: str) -> dict[str, float | int]:
    """The temperature, top_p, top_k, repetition_penalty and min_p the checkpoint sets (none of them: empty)."""
    try:
        config = json.loads(generation_config) if generation_config else {}
    except json.JSONDecodeError:
        config = {}
    if not isinstance(config, dict):
        return {}
    return {name: max(0, int(config[name])) if name == "top_k" else float(config[name])
            for name in OPENAI_DEFAULTS if _valid(name, config.get(name))}


def model_sampling(generation_config: str, fallback: dict[str, float | int] = OPENAI_DEFAULTS,
                   **given) -> SamplingParams:
    """SamplingParams: the values `given` (None: not given), else the checkpoint's, else `fallback`'s."""
    values = {**fallback, **checkpoint_sampling(generation_config), **{k: v for k, v in given.items() if v is not None}}
    values["top_k"] = max(0, values["top_k"])  # vLLM's -1, as 0, disables it
    return SamplingParams(**values)
