"""The Python client of a Tandem coordinator (no torch needed).

    from coordinator.client import TandemClient
    with TandemClient("127.0.0.1:50050") as client:
        result = client.generate(prompt="def main(", max_new_tokens=32)
        for delta in client.generate_stream(prompt="def main(", stop=["\\n\\n"]):
            print(delta.text, end="", flush=True)

Generation parameters: max_new_tokens, num_draft_tokens, temperature, top_k, top_p, seed,
stop_token_ids, stop (strings), ignore_eos, speculate, tree (an EAGLE-2 draft tree). Errors raise
TandemError with the gRPC status code (INVALID_ARGUMENT for bad parameters, UNAVAILABLE while the server drains, ...).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path

import grpc
from pydantic import BaseModel

from tandem import security
from tandem.convert import grammar_to_pb, stats_from_pb
from tandem.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc

DEFAULT_MAX_MESSAGE_MIB = 16
API_KEY_ENV = "TANDEM_API_KEY"  # the key the client sends when none is given


def key_metadata(api_key: str | None = None) -> tuple[tuple[str, str], ...] | None:
    """The call metadata that carries `api_key` (default $TANDEM_API_KEY); None without a key."""
    api_key = api_key or os.environ.get(API_KEY_ENV)
    return (("authorization", f"Bearer {api_key}"),) if api_key else None


class TandemError(RuntimeError):
    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


class GenerateResult(BaseModel):
    """The same fields as `generate --in-process`: generated ids, their text, why it stopped, stats."""

    token_ids: list[int]
    text: str | None = None
    finish_reason: str
    stats: dict


class GenerateDelta(BaseModel):
    """One streamed piece; the last one has finish_reason and stats."""

    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    stats: dict | None = None


def build_request(
    prompt: str | None = None,
    prompt_ids: Sequence[int] | None = None,
    *,
    max_new_tokens: int | None = None,
    num_draft_tokens: int | None = None,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float | None = None,
    seed: int | None = None,
    stop_token_ids: Sequence[int] = (),
    stop: Sequence[str] | str = (),
    ignore_eos: bool = False,
    speculate: bool | None = None,
    messages: Sequence[dict] | None = None,
    tree: dict | object | None = None,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    repetition_penalty: float | None = None,
    min_p: float = 0.0,
    min_tokens: int = 0,
    grammar: dict | object | None = None,
) -> coordinator_pb2.GenerateRequest:
    """`messages`: a conversation ([{"role": "user", "content": ...}, ...]) in place of a prompt; the
    coordinator renders it with the target's chat template. `tree`: an EAGLE-2 draft tree instead of a
    chain, as {"nodes": N, "depth": D, "top_k": K} (or a TreeParams); a key left out takes the default.
    `grammar`: a structured output, as a GrammarSpec or one key of the wire's Grammar ({"json_schema": text},
    {"regex": ...}, {"choice": [...]}, {"grammar": lark}, {"json_object": True})."""
    if sum(x is not None for x in (prompt, prompt_ids, messages)) != 1:
        raise ValueError("give exactly one of prompt, prompt_ids and messages")
    sampling = common_pb2.SamplingParams(temperature=temperature, top_k=top_k)
    if top_p is not None:
        sampling.top_p = top_p
    if seed is not None:
        sampling.seed = seed
    sampling.presence_penalty, sampling.frequency_penalty, sampling.min_p = presence_penalty, frequency_penalty, min_p
    if repetition_penalty is not None:
        sampling.repetition_penalty = repetition_penalty
    request = coordinator_pb2.GenerateRequest(
        prompt=prompt or "",
        prompt_ids=list(prompt_ids or []),
        sampling=sampling,
        stop_token_ids=list(stop_token_ids),
        stop=[stop] if isinstance(stop, str) else list(stop),
        ignore_eos=ignore_eos,
        messages=[coordinator_pb2.ChatMessage(role=m["role"], content=m.get("content") or "") for m in messages or ()],
    )
    if max_new_tokens is not None:
        request.max_new_tokens = max_new_tokens
    if num_draft_tokens is not None:
        request.num_draft_tokens = num_draft_tokens
    if speculate is not None:
        request.speculate = speculate
    if tree is not None:
        fields = tree if isinstance(tree, dict) else tree.model_dump()
        request.tree.CopyFrom(common_pb2.TreeParams(**fields))
    if min_tokens:
        request.min_tokens = min_tokens
    if grammar is not None:
        request.grammar.CopyFrom(common_pb2.Grammar(**grammar) if isinstance(grammar, dict)
                                 else grammar_to_pb(grammar))
    return request


class TandemClient:
    def __init__(self, address: str, timeout: float | None = None, max_message_mib: int = DEFAULT_MAX_MESSAGE_MIB,
                 lb_policy: str | None = None, api_key: str | None = None, tls_ca: str | Path | None = None):
        """`address`: HOST:PORT, or any gRPC target such as dns:///tandem-headless.tandem.svc.cluster.local:50050
        (every pair behind a Kubernetes headless Service). `lb_policy`: how calls spread over the addresses
        the name resolves to; default round_robin for a dns: target (one call to each pair in turn), gRPC's
        pick_first (one address) otherwise. `timeout`: the default deadline of each call in seconds (None:
        none); the server then cancels the generation and frees its sessions when the deadline passes.
        `api_key`: sent as `authorization: Bearer` (default $TANDEM_API_KEY). `tls_ca`: the CA of the
        coordinator's certificate, for TLS (default $TANDEM_TLS_CA; none: plain)."""
        self.address = address
        self.timeout = timeout
        self.lb_policy = lb_policy or ("round_robin" if address.startswith("dns:") else None)
        limit = max_message_mib << 20
        options = [("grpc.max_send_message_length", limit), ("grpc.max_receive_message_length", limit)]
        if self.lb_policy is not None:
            options.append(("grpc.lb_policy_name", self.lb_policy))
        self._channel = security.channel(address, options, security.client_tls(tls_ca))
        self._stub = coordinator_pb2_grpc.CoordinatorStub(self._channel)
        self._metadata = key_metadata(api_key)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(
        self, prompt: str | None = None, prompt_ids: Sequence[int] | None = None, *, timeout: float | None = None,
        **params,
    ) -> GenerateResult:
        request = build_request(prompt, prompt_ids, **params)
        try:
            response = self._stub.Generate(request, timeout=timeout if timeout is not None else self.timeout,
                                           metadata=self._metadata)
        except grpc.RpcError as exc:
            raise TandemError(exc.code(), exc.details() or "") from None
        return GenerateResult(
            token_ids=list(response.token_ids),
            text=response.text,
            finish_reason=response.finish_reason,
            stats=stats_from_pb(response.stats),
        )

    def generate_stream(
        self, prompt: str | None = None, prompt_ids: Sequence[int] | None = None, *, timeout: float | None = None,
        **params,
    ) -> Iterator[GenerateDelta]:
        """Deltas as tokens commit; closing the iterator early cancels the generation on the server."""
        request = build_request(prompt, prompt_ids, **params)
        call = self._stub.GenerateStream(request, timeout=timeout if timeout is not None else self.timeout,
                                        metadata=self._metadata)
        try:
            for msg in call:
                yield GenerateDelta(
                    token_ids=list(msg.token_ids),
                    text=msg.text,
                    finish_reason=msg.finish_reason or None,
                    stats=stats_from_pb(msg.stats) if msg.finish_reason else None,
                )
        except grpc.RpcError as exc:
            raise TandemError(exc.code(), exc.details() or "") from None
        finally:
            call.cancel()  # a no-op once finished; frees the server's sessions when the caller stopped early

    def server_info(self) -> coordinator_pb2.ServerInfoResponse:
        try:
            return self._stub.ServerInfo(coordinator_pb2.ServerInfoRequest(), timeout=self.timeout or 30,
                                        metadata=self._metadata)
        except grpc.RpcError as exc:
            raise TandemError(exc.code(), exc.details() or "") from None


def generate(address: str, prompt: str | None = None, prompt_ids: Sequence[int] | None = None, **params) -> GenerateResult:
    """One generation against the coordinator at `address`."""
    with TandemClient(address) as client:
        return client.generate(prompt, prompt_ids, **params)


def generate_stream(
    address: str, prompt: str | None = None, prompt_ids: Sequence[int] | None = None, **params
) -> Iterator[GenerateDelta]:
    """Deltas of one generation against the coordinator at `address`."""
    with TandemClient(address) as client:
        yield from client.generate_stream(prompt, prompt_ids, **params)
