"""Faults: the draft killed (kill -9) or hung (SIGSTOP) mid-generation, the target killed. The
generation finishes target-only with the same greedy output, speculation resumes once the draft is
back; a lost target ends in-flight generations with UNAVAILABLE, not a hang, and the coordinator
serves again when it returns. Its own processes: they get killed and restarted on their ports."""

from __future__ import annotations

import signal
import time

import grpc
import pytest
from helpers import StepByStep
from processes import start_stack, stop_stack, wait_for_no_sessions

from coordinator.client import TandemClient, TandemError
from tandem.params import GenerationRequest
from tandem.protocol import DraftUnavailable
from tandem.service import health_status
from tandem_tools.inprocess import InProcessGenerator, run_rounds

LONG = {"prompt_ids": [11, 12, 13, 14], "max_new_tokens": 400, "ignore_eos": True, "num_draft_tokens": 3}


@pytest.fixture(scope="module")
def stack(tiny_dir, tmp_path_factory):
    procs = start_stack(tiny_dir, tmp_path_factory.mktemp("faults"),
                        coordinator_args=["--draft-timeout", "1"])
    yield procs
    stop_stack(procs)


@pytest.fixture(scope="module")
def client(stack):
    with TandemClient(stack["coordinator"].address, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def target_only(client):
    return client.generate(**{**LONG, "speculate": False}).token_ids


def wait_until(predicate, timeout: float, what: str) -> float:
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout, f"not within {timeout}s: {what}"
        time.sleep(0.05)
    return time.monotonic() - start


def draft_attached(client: TandemClient) -> bool:
    return client.server_info().draft_attached


def stream_with_fault(client: TandemClient, fault) -> tuple[list[int], dict]:
    """A long greedy generation; `fault()` runs after its first few deltas."""
    stream = client.generate_stream(**LONG)
    tokens: list[int] = []
    last = None
    for i, delta in enumerate(stream):
        tokens += delta.token_ids
        last = delta
        if i == 5:
            fault()
    return tokens, last.stats


def assert_speculation_resumes(stack, client, target_only) -> None:
    wait_until(lambda: draft_attached(client), 30, "the coordinator reattaches the draft")
    result = client.generate(**LONG)
    assert result.token_ids == target_only
    assert result.stats["num_draft_tokens"] > 0 and result.stats["num_rounds_without_draft"] == 0
    wait_for_no_sessions(stack["target"].address, stack["draft"].address)


def test_a_killed_draft_leaves_the_output_unchanged_and_speculation_resumes_after_a_restart(stack, client,
                                                                                           target_only):
    tokens, stats = stream_with_fault(client, stack["draft"].kill)
    assert tokens == target_only
    assert stats["num_draft_tokens"] > 0  # speculated before the kill...
    assert stats["num_rounds_without_draft"] > 0  # ...and went on without
    assert not draft_attached(client)
    assert health_status(stack["coordinator"].address) == "SERVING"  # degraded, not down

    while_down = client.generate(**LONG)  # a new request while the draft is down: target-only
    assert while_down.token_ids == target_only
    assert while_down.stats["num_draft_tokens"] == 0
    # every round but a last one with room for the bonus token only (it drafts nothing anyway); target-only rounds
    # decode several tokens each (Verify.decode), so whether such a last round comes depends on where they end
    rounds = while_down.stats["num_rounds"]
    assert rounds - 1 <= while_down.stats["num_rounds_without_draft"] <= rounds and rounds > 1

    stack["draft"].restart()  # on the same port
    assert_speculation_resumes(stack, client, target_only)


def test_a_hung_draft_is_cut_off_after_its_deadline_and_reattached_when_it_answers(stack, client, target_only):
    draft = stack["draft"]
    started = time.monotonic()
    try:
        tokens, stats = stream_with_fault(client, lambda: draft.proc.send_signal(signal.SIGSTOP))
    finally:
        draft.proc.send_signal(signal.SIGCONT)
    assert tokens == target_only
    assert stats["num_rounds_without_draft"] > 0
    assert time.monotonic() - started < 30
    assert_speculation_resumes(stack, client, target_only)


def test_a_killed_target_ends_the_generation_with_unavailable_and_the_coordinator_recovers(stack, client,
                                                                                          target_only):
    coordinator, target = stack["coordinator"], stack["target"]
    started = time.monotonic()
    with pytest.raises(TandemError) as info:
        stream_with_fault(client, target.kill)
    assert time.monotonic() - started < 15  # the client's deadline is 120 s: no hang
    assert info.value.code == grpc.StatusCode.UNAVAILABLE
    assert "target service" in info.value.details

    wait_until(lambda: health_status(coordinator.address) == "NOT_SERVING", 10, "the coordinator reports it")
    refused = time.monotonic()
    with pytest.raises(TandemError) as info:
        client.generate(prompt_ids=[5, 6, 7], max_new_tokens=4)
    assert info.value.code == grpc.StatusCode.UNAVAILABLE and "target service" in info.value.details
    assert time.monotonic() - refused < 5

    target.restart()  # on the same port
    wait_until(lambda: health_status(coordinator.address) == "SERVING", 30, "the coordinator serves again")
    result = client.generate(**LONG)
    assert result.token_ids == target_only and result.stats["num_draft_tokens"] > 0
    wait_for_no_sessions(target.address, stack["draft"].address)


# -- the round loop, in-process ---------------------------------------------------------------------


class FailingDraft(StepByStep):
    """The real draft engine until its `fail_at`-th propose, which fails with DraftUnavailable."""

    def __init__(self, engine, fail_at: int):
        self.engine, self.fail_at, self.calls, self.released = engine, fail_at, 0, []

    def propose(self, session_id, features, next_tokens, num_draft_tokens, create=False):
        self.calls += 1
        if self.calls == self.fail_at:
            raise DraftUnavailable("draft service: UNAVAILABLE: Socket closed")
        return self.engine.propose(session_id, features, next_tokens, num_draft_tokens, create)

    def release(self, session_id):
        self.released.append(session_id)
        return self.engine.release(session_id)


@pytest.fixture(scope="module")
def generator(tiny_dir):
    return InProcessGenerator(tiny_dir / "target", tiny_dir / "draft", draft_cost=0)


@pytest.mark.parametrize("fail_at", [1, 2, 7])
def test_the_round_loop_goes_on_target_only_when_the_draft_fails(generator, fail_at):
    request = GenerationRequest(prompt_ids=[3, 4, 5], max_new_tokens=40, ignore_eos=True, num_draft_tokens=3)
    alone = generator.generate(request.model_copy(update={"speculate": False})).token_ids
    draft = FailingDraft(generator.draft, fail_at)
    tokens, event = [], None
    for event in run_rounds(generator.target, draft, request, max_context=generator.target.max_context):
        tokens += event.new_tokens
    assert tokens == alone
    stats = event.stats
    assert stats.num_draft_tokens == 3 * (fail_at - 1)
    # the rounds after the failure, but the last (room for the bonus token only: no drafts anyway)
    assert stats.num_rounds_without_draft == stats.num_rounds - (fail_at - 1) - 1
    assert draft.calls == fail_at  # never asked again after the failure
    assert draft.released and generator.draft.num_sessions == 0 and generator.target.num_sessions == 0
