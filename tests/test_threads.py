"""A CPU target's forwards borrowing the draft's CPUs (target_server/threads.py): timed both ways, chosen by
the measurement, the caller's affinity and threads restored, and only for models whose output cannot depend
on the thread count."""

from __future__ import annotations

import os
import threading
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from tandem.config import TargetSettings, parse_cpus
from tandem.packed import pack_linears
from target_server import threads
from target_server.threads import ThreadBurst, thread_invariant

CPUS = sorted(os.sched_getaffinity(0))


def _steps(tokens: int) -> list:
    return [SimpleNamespace(ids=[0] * tokens)]


def test_a_width_class_measures_both_ways_then_keeps_the_faster_until_revisited(monkeypatch):
    monkeypatch.setattr(threads, "REVISIT", 10)
    width = threads._WidthClass()
    seen = []
    for i in range(2 * threads.EXPLORE):
        wide = width.next_wide()
        seen.append(wide)
        width.record(wide, (1.0 if wide else 1.5) + (i % 4) * 0.2)  # borrowed faster, the two ways overlapping
    assert seen == [False, True] * threads.EXPLORE
    assert width.wide is True
    assert all(width.next_wide() for _ in range(9))
    assert width.next_wide() is False  # the tenth since the choice: measured again, own CPUs first
    for _ in range(2 * threads.EARLY):
        wide = width.next_wide()
        width.record(wide, 2.0 if wide else 1.0)  # now every borrowed forward slower (the draft busy)
    assert width.wide is False  # decided early: the two ways did not overlap


def test_borrowing_must_gain_more_than_noise():
    width = threads._WidthClass()
    for _ in range(2 * threads.EXPLORE):
        wide = width.next_wide()
        width.record(wide, 0.98 if wide else 1.0)  # 2% faster: not worth a second thread
    assert width.wide is False


@pytest.mark.skipif(len(CPUS) < 2, reason="needs two CPUs")
def test_a_forward_borrows_the_cpus_with_workers_that_yield_and_the_thread_gets_its_own_back(monkeypatch):
    seen: list[tuple[frozenset[int], int]] = []
    errors: list[BaseException] = []
    a = torch.randn(256, 256)
    # the forwards' time on a clock of the test's: slept for, a busy CI machine made a borrowed forward no
    # faster than its own CPU's, and the class chose to keep to it (seen in CI)
    clock = [0.0]
    monkeypatch.setattr(threads, "time", SimpleNamespace(perf_counter=lambda: clock[0]))

    def forward(steps, scale):
        cpus, count = frozenset(os.sched_getaffinity(0)), torch.get_num_threads()
        seen.append((cpus, count))
        (a @ a).sum()  # a parallel region: OpenMP starts this thread's workers on the first wide call
        clock[0] += scale * (0.002 if count == 1 else 0.001)
        return len(steps)

    def pinned():  # as a handler thread of a target that `tandem serve` pinned to its first CPU
        try:
            os.sched_setaffinity(0, {CPUS[0]})
            torch.set_num_threads(1)
            burst = ThreadBurst(frozenset(CPUS))
            for _ in range(2 * threads.EXPLORE + 3):
                assert burst.run(_steps(16), forward, 1.0) == 1
                assert os.sched_getaffinity(0) == {CPUS[0]} and torch.get_num_threads() == 1
            assert burst.wide_classes() == [16]
            burst.run(_steps(1), forward, 1.0)  # another width class measures afresh
            assert seen[-1] == (frozenset({CPUS[0]}), 1)
            assert burst._workers and all(os.getpriority(os.PRIO_PROCESS, tid) == threads.WORKER_NICE
                                          and os.sched_getaffinity(tid) == set(CPUS) for tid in burst._workers)
            assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == 0
        except BaseException as exc:  # noqa: BLE001 - re-raised on the test's thread
            errors.append(exc)

    worker = threading.Thread(target=pinned)
    worker.start()
    worker.join()
    if errors:
        raise errors[0]
    own, first_wide, wide = (frozenset({CPUS[0]}), 1), (frozenset(CPUS), len(CPUS)), (frozenset({CPUS[0]}), len(CPUS))
    assert seen[: 2 * threads.EARLY] == [own, first_wide] + [own, wide] * (threads.EARLY - 1)  # alternating
    assert seen[-4:-1] == [wide] * 3  # chosen (early, unless the first wide call's start-up blurred it)


def test_without_cpus_to_borrow_a_forward_runs_as_it_is():
    burst = ThreadBurst()
    assert burst.run(_steps(64), lambda steps: torch.get_num_threads()) == torch.get_num_threads()
    assert burst.wide_classes() == []


def test_only_a_model_whose_products_are_all_packed_may_change_its_threads():
    model = nn.Sequential(nn.Linear(1024, 512), nn.Linear(512, 512))  # 2^19 and 2^18 weights
    assert thread_invariant(model) == "2 of its linear layers are not packed"
    pack_linears(model)
    assert thread_invariant(model) is None
    assert thread_invariant(nn.Sequential(nn.Linear(192, 512))) == "1 of its linear layers are not packed"


def test_the_target_takes_cpus_to_borrow_that_it_is_pinned_away_from(tiny_dir):
    settings = TargetSettings(model=tiny_dir / "target", burst_cpus="0-1")
    assert settings.burst_cpus == "0-1"
    assert parse_cpus("0-1", available=False) == {0, 1}
    with pytest.raises(ValueError, match="looks like"):
        TargetSettings(model=tiny_dir / "target", burst_cpus="1-0")


def test_serve_hands_a_cpu_host_s_children_their_cpus_and_threads_as_variables(tiny_dir, monkeypatch):
    """No flags: `tandem serve` splits a CPU host's CPUs and sets each child's own variables, which its settings
    read (a GPU target gets none: nothing to split)."""
    from tandem.config import CoordinatorSettings, DraftSettings, format_cpus
    from tandem_tools.serve import child_env, cpu_threads, split_cpus

    assert split_cpus("cuda:0") is None and cpu_threads("cuda:0", "cuda:1") == {"target": None, "draft": None}
    cpus = {"target": [0, 1], "draft": [2]}
    threads_of = cpu_threads("cpu", "cpu", cpus)
    assert threads_of == {"target": 2, "draft": 1}
    env = {**child_env("target", threads=threads_of["target"], cpus=format_cpus(cpus["target"]), burst_cpus="0-2"),
           **child_env("draft", threads=threads_of["draft"], cpus="2"), **child_env("coordinator", cpus="2")}
    assert env == {"TANDEM_TARGET_THREADS": "2", "TANDEM_TARGET_CPUS": "0-1", "TANDEM_TARGET_BURST_CPUS": "0-2",
                   "TANDEM_DRAFT_THREADS": "1", "TANDEM_DRAFT_CPUS": "2", "TANDEM_COORDINATOR_CPUS": "2"}
    mine = format_cpus(os.sched_getaffinity(0))  # the settings check that a process may run on its CPUs
    for key, value in {**env, "TANDEM_TARGET_CPUS": mine, "TANDEM_DRAFT_CPUS": mine,
                       "TANDEM_COORDINATOR_CPUS": mine}.items():
        monkeypatch.setenv(key, value)
    target = TargetSettings(model=tiny_dir / "target")
    draft = DraftSettings(model=tiny_dir / "draft", target=tiny_dir / "target")
    assert (target.threads, target.cpus, target.burst_cpus) == (2, mine, "0-2")
    assert (draft.threads, draft.cpus) == (1, mine)
    assert CoordinatorSettings(target_addr="h:1").cpus == mine
    if len(os.sched_getaffinity(0)) >= 2:  # this host's split: the first half to the target, the rest to the others
        split = split_cpus("cpu")
        assert split["target"] + split["draft"] == sorted(os.sched_getaffinity(0)) and split["draft"]
