"""Target-only decodes of several tokens a call (target_server/decode.py): callers' decodes step together."""

from __future__ import annotations

import threading
import time

from tandem.protocol import VerifyResult
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
                               [(s, decode, stop) for s in sessions])

    a = threading.Thread(target=call, args=("a", ["a0", "a1"], 4, []))
    a.start()
    while len(batches) < 2:
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
    good, bad, plain = loop.after([first, first, first], [("good", 3, []), ("bad", 3, []), ("plain", 1, [])])
    assert (good.accepted, good.bonus) == ([0, 1], 2)
    assert isinstance(bad, ValueError)
    assert plain is first


def test_a_decode_answers_with_what_it_has_once_its_time_is_up(monkeypatch):
    monkeypatch.setattr(decode, "ANSWER_WITHIN_S", 0.05)

    def steps(going):
        time.sleep(0.03)  # a slow model's token
        return [VerifyResult(accepted=[], bonus=token + 1, features=None) for _, token in going]

    (slow,) = DecodeLoop(steps).after([VerifyResult(accepted=[], bonus=0, features=None)], [("s", 16, [])])
    assert 2 <= len(slow.accepted) + 1 <= 3  # the first token, then a step or two within 50 ms
