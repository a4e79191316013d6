"""The routes of the OpenAI-compatible front: a Starlette app over the coordinator's Generations.

    GET  /v1/models             the served model (--served-model-name, default the target's directory name)
    POST /v1/completions        prompt text or token ids (or a batch of them)
    POST /v1/chat/completions   messages rendered with the target's chat template (coordinator/chat.py)
    GET  /health                200 while the coordinator serves, 503 while connecting, without its target, draining
    GET  /metrics               the coordinator's Prometheus registry (its spec_decode counters also
                                under vLLM's names, which `vllm bench serve` reads)
    POST /tokenize, /detokenize, GET /version   as vLLM has them (tokens.py)

Any other path (or method) is OpenAI's JSON error object, 404 (405). Each choice (n per prompt) is one
generation on a thread of its own (choice.py). A client that goes away (a closed connection, a stream
it stops reading) makes the Call inactive and cancels both services' session streams at once.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from pathlib import Path

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from coordinator.chat import render_chat
from coordinator.generation import ClientRequest, Generations
from coordinator.http.answer import Answer, error_response
from coordinator.http.choice import Choice
from coordinator.http.protocol import (
    INVALID,
    ChatRequest,
    CompletionRequest,
    HTTPError,
    bad_request,
    http_error,
)
from coordinator.http.tokens import detokenize_answer, fim_prompt, tokenize, tokenize_answer, version
from coordinator.http.tools import parser_for, template_messages
from coordinator.model_defaults import model_sampling
from coordinator.monitor import Pair
from tandem.errors import Abort
from tandem.metrics import vllm_spec_decode_aliases
from tandem.params import GenerationRequest
from tandem.text import TextDelta


class Front:
    """The routes, over the coordinator's generations."""

    def __init__(self, generations: Generations, served_model_name: str | None = None,
                 chat_template: str | None = None):
        self.generations = generations
        self.served_model_name = served_model_name
        self.chat_template = chat_template  # --chat-template: in place of the target checkpoint's
        self.created = int(time.time())

    # -- what the front serves -------------------------------------------------------------------

    def model_name(self, pair: Pair | None = None) -> str:
        """The served name: --served-model-name, else the target's as the monitor last saw it (up or not: a
        target marked down for late health checks while a request ran must not fail that request's answer)."""
        if self.served_model_name:
            return self.served_model_name
        monitor = self.generations.monitor
        pair = pair or (monitor.current if monitor is not None else None) or self.generations.pair()
        return Path(pair.target_info.model).name or pair.target_info.model

    def serving(self) -> tuple[bool, str]:
        service, monitor = self.generations.service, self.generations.monitor
        if service.admission.draining:
            return False, "draining"
        if not service.admission.ready or monitor is None:
            return False, "connecting to its services"
        if not monitor.target.up:
            return False, f"the target service is down ({monitor.target.reason})"
        return True, "serving"

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name():
            raise HTTPError(404, INVALID, f"The model `{model}` does not exist; this server serves "
                            f"`{self.model_name()}`", "model", "model_not_found")

    def app(self) -> Starlette:
        return Starlette(routes=[
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/tokenize", self.tokenize, methods=["POST"]),
            Route("/detokenize", self.detokenize, methods=["POST"]),
            Route("/version", self.version, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
        ], exception_handlers={HTTPException: _route_error})

    async def health(self, request: Request) -> Response:
        up, why = self.serving()
        return Response(status_code=200 if up else 503, content="" if up else why)

    async def metrics(self, request: Request) -> Response:
        text = generate_latest(self.generations.service.registry)
        return Response(text + vllm_spec_decode_aliases(text), media_type=CONTENT_TYPE_LATEST)

    async def models(self, request: Request) -> Response:
        try:
            pair = self.generations.pair()
        except Abort as exc:
            return error_response(http_error(exc))
        return JSONResponse({"object": "list", "data": [{
            "id": self.model_name(pair), "object": "model", "created": self.created, "owned_by": "tandem",
            "root": pair.target_info.model, "max_model_len": pair.target_info.max_context,
        }]})

    async def version(self, request: Request) -> Response:
        return JSONResponse(version())

    async def tokenize(self, request: Request) -> Response:
        return await self._answer(request, tokenize_answer)

    async def detokenize(self, request: Request) -> Response:
        return await self._answer(request, detokenize_answer)

    async def _answer(self, request: Request, answer: Callable[[Front, dict], dict]) -> Response:
        try:
            return JSONResponse(answer(self, await _body(request)))
        except Exception as exc:  # noqa: BLE001 - every error is the client's answer
            return error_response(http_error(exc))

    # -- the two generation endpoints -----------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        return await self._serve(request, CompletionRequest, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._serve(request, ChatRequest, chat=True)

    async def _serve(self, request: Request, model, chat: bool) -> Response:
        try:
            params = model.model_validate(await _body(request))
            self.check_model(params.model)
            choices = self._start(params, chat)
        except Exception as exc:  # noqa: BLE001 - every error is the client's answer
            return error_response(http_error(exc))
        try:
            first = [await _first(choice) for choice in choices]  # errors before any output: an HTTP status
        except Exception as exc:  # noqa: BLE001
            for choice in choices:
                choice.close()
            return error_response(http_error(exc))
        pair = self.generations.monitor.current
        answer = Answer(self.model_name(pair), pair.tokenizer if pair is not None else None, params, chat, choices, first,
                        parser_for(self.chat_template or (pair.target_info.chat_template if pair else None)))
        if params.stream:
            return StreamingResponse(answer.events(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await answer.whole(request)

    def _start(self, params, chat: bool) -> list[Choice]:
        """One Choice per prompt and sample: seeds seed, seed+1, ... when seeded."""
        loop = asyncio.get_running_loop()
        prompts = [None] if chat else params.prompts
        choices = []
        for prompt in prompts:
            for i in range(params.n):
                seed = params.seed + i if params.seed is not None else None
                choices.append(Choice(self.generations, self._builder(params, chat, prompt, seed), loop))
        return choices

    def render(self, pair: Pair, params) -> list[int]:
        """A chat request's (or a chat /tokenize's) conversation as the prompt's token ids."""
        text = render_chat(
            self.chat_template or pair.target_info.chat_template,
            template_messages([m.model_dump(exclude_none=True) for m in params.messages]),
            dict(pair.target_info.special_tokens), params.generation_prompt, params.continue_final_message,
            params.documents, params.chat_template_kwargs, params.tools,
        )
        return tokenize(pair, text, params.add_special_tokens)

    def _builder(self, params, chat: bool, prompt, seed: int | None) -> Callable[[Pair], ClientRequest]:
        def build(pair: Pair) -> ClientRequest:
            if chat:
                ids = self.render(pair, params)
                max_new, logprobs = params.max_new_tokens, params.wanted_logprobs
            else:
                if params.suffix:
                    if not isinstance(prompt, str):
                        raise bad_request("`suffix` needs the prompt as text", "suffix")
                    ids = fim_prompt(pair.tokenizer, prompt, params.suffix)
                else:
                    ids = tokenize(pair, prompt, params.add_special_tokens) if isinstance(prompt, str) else list(prompt)
                max_new, logprobs = params.max_tokens, params.logprobs
            ids = _truncated(ids, params.truncate_prompt_tokens, pair.target_info.max_context)
            optional = {"num_draft_tokens": params.num_draft_tokens} if params.num_draft_tokens is not None else {}
            generation = GenerationRequest(
                prompt_ids=ids,
                max_new_tokens=max_new or pair.target_info.max_context,  # unset: what fits (fit_to_pair)
                sampling=model_sampling(pair.target_info.generation_config, temperature=params.temperature,
                                        top_p=params.top_p, top_k=params.top_k, seed=seed, logprobs=logprobs,
                                        presence_penalty=params.presence_penalty,
                                        frequency_penalty=params.frequency_penalty,
                                        repetition_penalty=params.repetition_penalty, min_p=params.min_p),
                stop_token_ids=params.stop_token_ids, ignore_eos=params.ignore_eos, speculate=params.speculate,
                grammar=params.grammar, min_tokens=params.min_tokens, **optional,
            )
            return ClientRequest(generation, params.stops, max_new_tokens_given=max_new is not None,
                                 include_stop_str=params.include_stop_str_in_output,
                                 skip_special_tokens=params.skip_special_tokens)

        return build


async def _body(request: Request) -> dict:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise bad_request(f"the body is not JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request("the body must be a JSON object", code="invalid_json")
    return body


async def _route_error(request: Request, exc: HTTPException) -> Response:
    """A path no route has (404) or a method it does not take (405): OpenAI's error object, not text."""
    what = "Invalid URL" if exc.status_code == 404 else "Method not allowed"
    error = HTTPError(exc.status_code, INVALID, f"{what} ({request.method} {request.url.path})",
                      code="unknown_url" if exc.status_code == 404 else None)
    return JSONResponse(error.body, status_code=exc.status_code, headers=exc.headers)


def _truncated(ids: list[int], keep: int | None, max_context: int) -> list[int]:
    """vLLM's truncate_prompt_tokens: the prompt's last `keep` tokens (-1: the context's worth)."""
    if keep is None:
        return ids
    if keep > max_context:
        raise bad_request(f"truncate_prompt_tokens {keep} is past the model's context of {max_context} tokens",
                          "truncate_prompt_tokens", "context_length_exceeded")
    return ids[-(max_context if keep == -1 else keep):]


async def _first(choice: Choice) -> TextDelta | None:
    return await choice.next()
