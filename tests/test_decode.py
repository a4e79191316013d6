"""Target-only decodes of several tokens a call (target_server/decode.py): callers' decodes step together."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

from tandem.protocol import VerifyResult
from tandem.sessions import InvalidRequest
from target_server import decode
from target_server.decode import DecodeLoop


def test_decodes_of_two_callers_step_in_one_batch_and_each_caller_gets_its_own_tokens(monkeypatch):
    monkeypatch.setattr(decode, "ANSWER_WITHIN_S", 30.0)  # this test's steps wait for each other
    batches: list[list[str]] = []
    second_in = threading.Event()

    def steps(going: list[tuple[str, int]]) -> list:
        batches.append([session for session, _ in going])
        if len(batches) == 2:
            second_in.wait(5)  # the second caller joins while this batch runs
            time.sleep(0.05)
        return [VerifyResult(accepted=[], bonus=token + 1, features=None) for _, token in going]

    loop = DecodeLoop(steps)
    first = lambda token: VerifyResult(accepted=[], bonus=token, features=None)
    out: dict[str, list] = {}

    def call(name: str, sessions: list[str], decode: int, stop: list[int]) -> None:
        out[name] = loop.after([first(100 * i) for i in range(len(sessions))],
                               [(s, decode, stop, 0) for s in sessions])

    a = threading.Thread(target=call, args=("a", ["a0", "a1"], 4, []))
    a.start()
    give_up = time.monotonic() + 10  # a caller that died would leave this waiting
    while len(batches) < 2 and time.monotonic() < give_up:
        time.sleep(0.001)
    b = threading.Thread(target=call, args=("b", ["b0"], 6, [3]))
    b.start()
    time.sleep(0.02)
    second_in.set()
    a.join(5)
    b.join(5)
    assert [(r.accepted, r.bonus) for r in out["a"]] == [([0, 1, 2], 3), ([100, 101, 102], 103)]
    assert [(r.accepted, r.bonus) for r in out["b"]] == [([0, 1, 2], 3)]  # stopped after its stop id
    # stepped together from the second's joining on; alone once the first's were done
    assert batches == [["a0", "a1"], ["a0", "a1"], ["a0", "a1", "b0"], ["b0"], ["b0"]]


def test_a_failed_step_ends_only_the_decodes_it_held():
    def steps(going):
        return [ValueError("gone") if session == "bad" else VerifyResult(accepted=[], bonus=token + 1, features=None)
                for session, token in going]

    loop = DecodeLoop(steps)
    first = VerifyResult(accepted=[], bonus=0, features=None)
    good, bad, plain = loop.after([first, first, first], [("good", 3, [], 0), ("bad", 3, [], 0), ("plain", 1, [], 0)])
    assert (good.accepted, good.bonus) == ([0, 1], 2)
    assert isinstance(bad, ValueError)
    assert plain is first


def test_a_decode_answers_with_what_it_has_once_its_time_is_up(monkeypatch):
    monkeypatch.setattr(decode, "ANSWER_WITHIN_S", 0.05)

    def steps(going):
        time.sleep(0.03)  # a slow model's token
        return [VerifyResult(accepted=[], bonus=token + 1, features=None) for _, token in going]

    (slow,) = DecodeLoop(steps).after([VerifyResult(accepted=[], bonus=0, features=None)], [("s", 16, [], 0)])
    assert 2 <= len(slow.accepted) + 1 <= 3  # the first token, then a step or two within 50 ms


def test_a_cohorts_decodes_take_their_first_step_in_the_loops_batch_and_a_bad_one_fails_alone(monkeypatch):
    """DecodeLoop.cohort: a relay message's decodes join the steps already running (no batch of their own for
    a first step); its plain verifies run first, as they came; a decode its checks refuse fails alone."""
    monkeypatch.setattr(decode, "ANSWER_WITHIN_S", 30.0)
    batches: list[list[str]] = []
    joined = threading.Event()

    def steps(going):
        batches.append([session for session, _ in going])
        if len(batches) == 2:
            joined.wait(5)
            time.sleep(0.05)
        return [VerifyResult(accepted=[], bonus=token + 1, features=None) for _, token in going]

    loop = DecodeLoop(steps)

    def check(session_id, *args):
        if session_id == "bad":
            raise InvalidRequest("no such thing")

    plain = lambda calls: [VerifyResult(accepted=[], bonus=-1, features=None) for _ in calls]
    call = lambda session, token, n: ((session, token, [], False, None, None, n, []), None)
    out: dict[str, list] = {}
    first = threading.Thread(target=lambda: out.setdefault("a", loop.cohort([call("a", 0, 4)], check, plain)))
    first.start()
    give_up = time.monotonic() + 10  # a caller that died would leave this waiting
    while len(batches) < 2 and time.monotonic() < give_up:
        time.sleep(0.001)
    second = threading.Thread(target=lambda: out.setdefault("b", loop.cohort(
        [call("b", 10, 3), call("bad", 0, 3), call("v", 5, 1)], check, plain)))
    second.start()
    time.sleep(0.02)
    joined.set()
    first.join(5)
    second.join(5)
    assert [(r.accepted, r.bonus) for r in out["a"]] == [([1, 2, 3], 4)]
    b, bad, v = out["b"]
    assert (b.accepted, b.bonus) == ([11, 12], 13)
    assert isinstance(bad, InvalidRequest) and v.bonus == -1
    assert batches == [["a"], ["a"], ["a", "b"], ["a", "b"], ["b"]]  # b's first step is in the loop's batch


def test_once_one_decodes_time_is_up_every_decode_in_its_step_answers(monkeypatch):
    """They go back to the coordinator together and come back as one message, not in pieces that then step
    apart."""
    monkeypatch.setattr(decode, "ANSWER_WITHIN_S", 0.05)

    def steps(going):
        time.sleep(0.01)
        return [VerifyResult(accepted=[], bonus=token + 1, features=None) for _, token in going]

    loop = DecodeLoop(steps)
    out: dict[str, list] = {}
    early = threading.Thread(target=lambda: out.setdefault("early", loop.join([("e", 0, 64, [], 0)])))
    early.start()
    time.sleep(0.03)
    late = loop.join([("l", 0, 64, [], 0)])  # its own time is up 30 ms after the early one's
    early.join(5)
    (e,), (l,) = out["early"], late
    assert 1 <= len(l.accepted) + 1 < len(e.accepted) < 64  # back with the early one, with fewer tokens


def test_a_decode_asked_to_answer_later_runs_that_long():
    """Verify.answer_within_ms: a unary client's decode (the coordinator's Generate) answers once done, or once
    its own time is up, not after the target's 50 ms."""

    def steps(going):
        time.sleep(0.01)
        return [VerifyResult(accepted=[], bonus=token + 1, features=None) for _, token in going]

    (long,) = DecodeLoop(steps).join([("u", 0, 30, [], 2000)])
    assert (long.accepted, long.bonus) == (list(range(1, 30)), 30)  # all 30, though they took ~300 ms


def test_a_caller_woken_while_a_step_runs_gets_every_token_that_step_made_for_it(monkeypatch):
    """A decode ends only where a step's result is added: a caller woken mid-step after its time is up (here by
    notifies from the step, as another caller's return would) waits for the step it is in. Reading the clock
    itself, it answered without that step's token, which had moved the session on (seen in CI). The decodes'
    clock is the test's (a 20 ms step in 2 ms ticks), so that b's time is up in the middle of its second step
    however busy the machine; each tick gives the woken caller a real moment to look."""
    loop: DecodeLoop
    stepped: dict[str, int] = {"a": 0, "b": 0}
    ending = threading.Event()
    clock = [0.0]
    monkeypatch.setattr(decode, "time", SimpleNamespace(monotonic=lambda: clock[0]))

    def steps(going):
        for _ in range(10):
            clock[0] += 0.002
            with loop._changed:
                loop._changed.notify_all()
            time.sleep(0.001)
        if stepped["a"] == 1:  # b joins as a's second step ends: its time is up in the middle of its own second
            ending.set()
            while not any(session == "b" for session, _ in loop._active):
                time.sleep(0.0005)
        for session, _ in going:
            stepped[session] += 1
        return [VerifyResult(accepted=[], bonus=token + 1, features=None) for _, token in going]

    loop = DecodeLoop(steps)
    out: dict[str, list] = {}
    runner = threading.Thread(target=lambda: out.setdefault("a", loop.join([("a", 0, 12, [], 10_000)])))
    runner.start()
    assert ending.wait(5)
    (b,) = loop.join([("b", 100, 64, [], 30)])
    runner.join(5)
    (a,) = out["a"]
    assert len(a.accepted) + 1 == stepped["a"]  # (it answers with b: one message back)
    assert len(b.accepted) + 1 == stepped["b"] >= 2  # every step that moved b's session is in its answer
    assert b.accepted + [b.bonus] == list(range(101, 101 + stepped["b"]))
