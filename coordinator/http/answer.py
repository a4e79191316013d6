"""The response to one generation request, whole (one JSON object) or as server-sent events, from its
choices' deltas: OpenAI's chat.completion / text_completion objects and their chunks, with usage and
vLLM's per-request `metrics.speculative_decoding`."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from coordinator.http import tools
from coordinator.http.choice import Choice
from coordinator.http.logprobs import CompletionLogprobs, TokenText, chat_logprobs, merge_completion_logprobs
from coordinator.http.protocol import HTTPError, http_error, spec_metrics, usage
from tandem.text import TextDelta


def error_response(error: HTTPError) -> JSONResponse:
    return JSONResponse(error.body, status_code=error.status)


class Answer:
    """The response to one request, whole or as server-sent events."""

    def __init__(self, model: str, tokenizer, params, chat: bool, choices: list[Choice],
                 first: list[TextDelta | None], parser: str = "hermes"):
        self.params, self.chat, self.choices, self.first = params, chat, choices, first
        self.tool_mode = params.tool_mode if chat else "none"  # tools.py: tool calls parsed from the text
        self.parser = parser
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{params.request_id or uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.token_text = TokenText(tokenizer, params.return_tokens_as_token_ids)
        self.object = "chat.completion" if chat else "text_completion"
        self.stats = [None] * len(choices)
        self.completion_tokens = 0

    @property
    def wants_logprobs(self) -> bool:
        return (self.params.logprobs is not None) if not self.chat else self.params.logprobs

    @property
    def wants_ids(self) -> bool:
        return self.params.return_token_ids

    def _usage(self) -> dict:
        prompts = self.choices[:: self.params.n]  # the prompt is counted once for its n samples (as vLLM does)
        return usage(sum(c.prompt_tokens for c in prompts), self.completion_tokens)

    def _usage_so_far(self) -> dict:
        return {"usage": self._usage()} if self.params.continuous_usage else {}

    def _usage_and_metrics(self) -> dict:
        return {"usage": self._usage(), "metrics": spec_metrics([s for s in self.stats if s is not None])}

    async def whole(self, request: Request) -> Response:
        """Every choice to its end, unless the client goes away first (then all are cancelled)."""
        gone = asyncio.create_task(_disconnected(request))
        collect = asyncio.gather(*(self._collect(i) for i in range(len(self.choices))))
        try:
            await asyncio.wait({gone, collect}, return_when=asyncio.FIRST_COMPLETED)
            if not collect.done():  # the client left
                collect.cancel()
                return Response(status_code=499)
            results = collect.result()
        except Exception as exc:  # noqa: BLE001 - a choice failed mid-way
            return error_response(http_error(exc))
        finally:
            gone.cancel()
            for choice in self.choices:
                choice.close()
        ids = {"prompt_token_ids": self.choices[0].prompt_ids} if self.chat and self.wants_ids else {}
        return JSONResponse({"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                             "choices": results, **ids, **self._usage_and_metrics()})

    async def _collect(self, index: int) -> dict:
        choice, delta = self.choices[index], self.first[index]
        text, token_ids, logprobs, finish = [], [], [], None
        while delta is not None:
            text.append(delta.text)
            token_ids += delta.token_ids
            logprobs += delta.logprobs or []
            if delta.finish_reason is not None:
                finish, self.stats[index] = delta.finish_reason, delta.stats
            delta = await choice.next()
        self.completion_tokens += len(token_ids)
        out = {"index": index, "finish_reason": finish, "logprobs": None}
        if self.wants_ids:  # vLLM's places: a completion's prompt on its choice, a chat's on the response
            out.update({"token_ids": token_ids} if self.chat else
                       {"prompt_token_ids": choice.prompt_ids, "token_ids": token_ids})
        if self.chat:
            out["message"], out["finish_reason"] = self._message("".join(text), finish)
            if self.wants_logprobs:
                out["logprobs"] = {"content": chat_logprobs(token_ids, logprobs, self.token_text)}
        else:
            out["text"] = "".join(text)
            if self.wants_logprobs:
                out["logprobs"] = merge_completion_logprobs([CompletionLogprobs(self.token_text).add(token_ids, logprobs)])
        return out

    def _message(self, text: str, finish: str | None) -> tuple[dict, str | None]:
        """A chat answer's message and finish reason: its tool calls parsed out where it has tools."""
        if self.tool_mode == "none":
            return {"role": "assistant", "content": text}, finish
        content, calls = tools.parse(text, self.tool_mode, self.params.tool_named, self.parser,
                                     self.params.parallel_tool_calls)
        message = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
        return message, ("tool_calls" if calls and finish == "stop" else finish)

    async def events(self) -> AsyncIterator[str]:
        """SSE: chunks as the choices' deltas come, then (stream_options.include_usage) the usage, then [DONE].
        A client that stops reading closes this generator: every choice is cancelled."""
        queue: asyncio.Queue = asyncio.Queue()
        pumps = [asyncio.create_task(self._pump(i, queue)) for i in range(len(self.choices))]
        logprobs = [CompletionLogprobs(self.token_text) for _ in self.choices]
        object_ = "chat.completion.chunk" if self.chat else "text_completion"
        try:
            if self.chat:  # the role first, as OpenAI sends it
                for i in range(len(self.choices)):
                    ids = {"prompt_token_ids": self.choices[0].prompt_ids} if self.wants_ids and i == 0 else {}
                    yield self._sse(object_, [{"index": i, "delta": {"role": "assistant", "content": ""},
                                               "logprobs": None, "finish_reason": None}], **ids)
            running, last, opened = len(self.choices), None, set()
            held = [""] * len(self.choices)  # with tools: a choice's text, parsed at its end
            while running:
                index, item = await queue.get()
                if item is None:
                    running -= 1
                    continue
                if isinstance(item, BaseException):
                    error = http_error(item)
                    yield f"data: {json.dumps(error.body)}\n\n"
                    break
                delta: TextDelta = item
                self.completion_tokens += len(delta.token_ids)
                if delta.finish_reason is not None:
                    self.stats[index] = delta.stats
                if self.tool_mode != "none":  # the calls are known once the answer is whole
                    held[index] += delta.text
                    if delta.finish_reason is None:
                        continue
                tokens_shown = self.wants_logprobs or self.wants_ids
                if not delta.text and delta.finish_reason is None and not (tokens_shown and delta.token_ids):
                    continue  # nothing to show yet (text held back: half a character, a possible stop string)
                piece = {"index": index, "logprobs": None, "finish_reason": delta.finish_reason}
                if self.wants_ids:
                    piece["token_ids"] = delta.token_ids
                    if not self.chat and index not in opened:
                        piece["prompt_token_ids"] = self.choices[index].prompt_ids
                opened.add(index)
                if self.chat and self.tool_mode != "none":
                    message, piece["finish_reason"] = self._message(held[index], delta.finish_reason)
                    piece["delta"] = {"content": message["content"]} if message["content"] else {}
                    if "tool_calls" in message:
                        piece["delta"]["tool_calls"] = [{"index": j, **call}
                                                        for j, call in enumerate(message["tool_calls"])]
                elif self.chat:
                    piece["delta"] = {"content": delta.text} if delta.text or delta.finish_reason is None else {}
                    if self.wants_logprobs:
                        piece["logprobs"] = {"content": chat_logprobs(delta.token_ids, delta.logprobs or [],
                                                                      self.token_text)}
                else:
                    piece["text"] = delta.text
                    if self.wants_logprobs:
                        piece["logprobs"] = logprobs[index].add(delta.token_ids, delta.logprobs or [])
                if delta.finish_reason is not None and running == 1 and not self.params.include_usage:
                    last = piece  # the request's last chunk carries its metrics
                    continue
                yield self._sse(object_, [piece], **self._usage_so_far())
            else:
                extra = self._usage_and_metrics()
                if last is not None:
                    yield self._sse(object_, [last], metrics=extra["metrics"])
                if self.params.include_usage:
                    yield self._sse(object_, [], usage=extra["usage"], metrics=extra["metrics"])
            yield "data: [DONE]\n\n"
        finally:
            for pump in pumps:
                pump.cancel()
            for choice in self.choices:
                choice.close()

    async def _pump(self, index: int, queue: asyncio.Queue) -> None:
        """One choice's deltas onto the request's queue; None at its end."""
        delta = self.first[index]
        try:
            while delta is not None:
                queue.put_nowait((index, delta))
                delta = await self.choices[index].next()
            queue.put_nowait((index, None))
        except Exception as exc:  # noqa: BLE001
            queue.put_nowait((index, exc))

    def _sse(self, object_: str, choices: list[dict], **extra) -> str:
        chunk = {"id": self.id, "object": object_, "created": self.created, "model": self.model,
                 "choices": choices, **extra}
        return f"data: {json.dumps(chunk)}\n\n"


async def _disconnected(request: Request) -> None:
    """Returns when the client closes its connection (the body has been read: the next message is that)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
