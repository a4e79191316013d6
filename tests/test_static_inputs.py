"""A compiled bucket's inputs live in static buffers (tandem/staging.Staged): every forward of the bucket
reads the same device tensors, which a CUDA graph captured over them needs, and the CPU runs that same path.
Compiled with dynamo's "eager" backend here (the graphs and guards as compiled code has them, none of
inductor's compile time)."""

from __future__ import annotations

import pytest
import torch
from helpers import compile_eagerly
from torch._dynamo.utils import counters

from tandem.params import SamplingParams
from tandem.staging import Staged
from tandem_tools.opcount import OpCounter
from target_server.engine import TargetEngine


def test_a_staged_buffer_answers_the_same_tensors_with_new_values():
    staged = Staged(torch.device("cpu"))
    first = staged.write([([1, 2, 3], torch.long), ([[4, 5]], torch.int32)])
    ids = [t.data_ptr() for t in first]
    with OpCounter() as ops:
        second = staged.write([([7, 8, 9], torch.long), ([[1, 0]], torch.int32)])
    assert ops.syncs == 0, dict(ops.sync_ops)
    assert [t.data_ptr() for t in second] == ids
    assert second[0].tolist() == [7, 8, 9] and second[1].tolist() == [[1, 0]]


def test_compiled_verifies_read_their_buckets_static_inputs_and_decode_as_eager(tiny_dir, monkeypatch):
    compile_eagerly(monkeypatch)
    eager = TargetEngine(tiny_dir / "target", engine="native")
    compiled = TargetEngine(tiny_dir / "target", engine="native", compile=True)
    seen: list[tuple[int, ...]] = []
    forward = compiled.runner._forward

    def recording(tokens, positions, batch):
        seen.append((tokens.data_ptr(), positions.data_ptr(), batch.slots.data_ptr(), batch.kv_idx.data_ptr()))
        return forward(tokens, positions, batch)

    compiled.runner._forward = recording
    outputs = []
    for engine in (eager, compiled):
        token = engine.prefill("s", [5, 6, 7, 8, 9], SamplingParams()).token
        tokens = [token]
        for drafts in ([1, 2, 3], [4, 5, 6], [7, 8, 9]):  # each verify 4 tokens: one bucket
            result = engine.verify("s", tokens[-1], drafts)
            tokens += [*result.accepted, result.bonus]
        engine.release("s")
        outputs.append(tokens)
    assert outputs[0] == outputs[1]
    verifies = seen[-3:]
    assert len(set(verifies)) == 1, verifies  # the same tensors each verify of the bucket
    token = compiled.prefill("t", [3, 4], SamplingParams()).token
    graphs = counters["stats"]["unique_graphs"]
    compiled.verify("t", token, [1, 2, 3])  # another session in the bucket: the same graph
    assert counters["stats"]["unique_graphs"] == graphs, "a static input recompiled its bucket"


def test_cuda_graphs_are_off_without_cuda_or_a_compiled_forward(monkeypatch):
    from target_server.graphs import graphs_enabled

    monkeypatch.setenv("TANDEM_CUDA_GRAPHS", "1")
    assert not graphs_enabled(torch.device("cpu"), True)
    assert not graphs_enabled(torch.device("cuda"), False)
    monkeypatch.setenv("TANDEM_CUDA_GRAPHS", "0")
    assert not graphs_enabled(torch.device("cuda"), True)


def test_a_background_compile_makes_each_buckets_first_graph_call_before_any_request(tiny_dir, monkeypatch):
    """With CUDA graphs on, the warm-up thread compiles and captures a bucket (the graph's first call) over the
    bucket's static inputs; a request in that bucket then replays it over the same tensors. On the CPU the
    capture is stood in for by a recorder of the calls (graphs.CudaGraphs' first call captures)."""
    import threading

    from target_server import runners

    compile_eagerly(monkeypatch)
    calls: list[tuple[tuple[int, int], str, tuple[int, int]]] = []

    class Recorder:
        def __init__(self, forward, device):
            self.forward = forward

        def __call__(self, key, tokens, positions, batch):
            calls.append((key, threading.current_thread().name, (tokens.data_ptr(), positions.data_ptr())))
            return self.forward(tokens, positions, batch)

    monkeypatch.setattr(runners, "graphs_enabled", lambda device, compiled: compiled)
    monkeypatch.setattr(runners, "CudaGraphs", Recorder)
    eager = TargetEngine(tiny_dir / "target", engine="native")
    graphed = TargetEngine(tiny_dir / "target", engine="native", compile="background")
    assert graphed.runner.warm_up.wait(120)
    warmed = {key: (thread, ptrs) for key, thread, ptrs in calls}
    assert warmed and all(thread == "tandem-compile" for thread, _ in warmed.values()), calls
    outputs = []
    for engine in (eager, graphed):
        token = engine.prefill("s", [5, 6, 7, 8, 9], SamplingParams()).token
        result = engine.verify("s", token, [1, 2, 3])
        engine.release("s")
        outputs.append([token, *result.accepted, result.bonus])
    assert outputs[0] == outputs[1]
    key, thread, ptrs = calls[-1]
    assert thread != "tandem-compile" and warmed[key] == ("tandem-compile", ptrs)  # replayed over its inputs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_graphed_verifies_decode_as_eager_on_cuda(tiny_dir, monkeypatch):
    monkeypatch.setenv("TANDEM_CUDA_GRAPHS", "1")
    eager = TargetEngine(tiny_dir / "target", device="cuda", engine="native", compile=False)
    graphed = TargetEngine(tiny_dir / "target", device="cuda", engine="native", compile=True)
    assert graphed.runner.graphs is not None
    outputs = []
    for engine in (eager, graphed):
        token = engine.prefill("s", [5, 6, 7, 8, 9], SamplingParams()).token
        tokens = [token]
        for drafts in ([1, 2, 3], [4, 5, 6], [7, 8, 9], [1, 1, 1]):
            result = engine.verify("s", tokens[-1], drafts)
            tokens += [*result.accepted, result.bonus]
        engine.release("s")
        outputs.append(tokens)
    assert outputs[0] == outputs[1]
    assert graphed.runner.graphs.graphs  # captured, then replayed
