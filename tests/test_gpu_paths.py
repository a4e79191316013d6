"""The CUDA paths: each defect found by reading the code before they first ran on a GPU, with the
test that failed before its fix. Where the logic can be reached without a GPU it runs here on the CPU
(NCCL's code path over gloo, the shm ring for the ring logic cuda-ipc shares, fake TransportCaps for the
handshake); the rest is marked `gpu` and skips cleanly without CUDA. bench/gpu_validate.py runs the
whole set of GPU paths end to end on one or two GPUs."""

from __future__ import annotations

import grpc
import pytest
import torch

from draft_server.checkpoint import load_draft

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# -- 9. the draft's RoPE stays float32 when the head is cast to bfloat16 ---------------------------------


def test_the_drafts_rotary_tables_stay_float32_when_the_head_runs_in_bfloat16(tiny_dir):
    """`.to(dtype=bfloat16)` casts buffers too: inv_freq in bf16 keeps 3 significant digits, and at
    position 3000 cos(3000 * f) is off by up to 1.7. The head's weights go bf16; its rotary tables not."""
    bf16 = load_draft(tiny_dir / "draft", tiny_dir / "target", dtype=torch.bfloat16)
    fp32 = load_draft(tiny_dir / "draft", tiny_dir / "target", dtype=torch.float32)
    assert bf16.fc.weight.dtype == torch.bfloat16
    assert bf16.rotary_emb.inv_freq.dtype == torch.float32
    positions = torch.tensor([[3000, 1, 17, 4095]])
    hidden = torch.zeros(1, 4, bf16.config.hidden_size)
    cos, sin = bf16.rotary_emb(hidden.to(torch.bfloat16), positions)
    cos_ref, sin_ref = fp32.rotary_emb(hidden, positions)
    # what is left is the bf16 rounding of cos and sin themselves (|x| <= 1: at most 2^-9)
    torch.testing.assert_close(cos.float(), cos_ref, atol=4e-3, rtol=0)
    torch.testing.assert_close(sin.float(), sin_ref, atol=4e-3, rtol=0)
    # and it stays so through any later cast or move
    assert bf16.to(torch.float16).rotary_emb.inv_freq.dtype == torch.float32


# -- 6. a draft batch whose steps' features are on two devices -------------------------------------------


class _OnAnotherDevice(torch.Tensor):
    """A step's features as a fast path leaves them, on another device than an inline step's: torch.cat
    of the two refuses, as it does for a CUDA tensor beside a CPU one; `.to(device)` brings them over."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.cat:
            raise RuntimeError("Expected all tensors to be on the same device")
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **(kwargs or {}))
            return out.as_subclass(torch.Tensor) if func is torch.Tensor.to else out


def _two_sessions(engine, tiny_dir):
    """Two draft sessions past their first propose; what their next step gets."""
    rng = torch.Generator().manual_seed(3)
    steps = []
    for sid, n in (("a", 6), ("b", 3)):
        engine.propose(sid, torch.randn(n, engine.feature_size, generator=rng), list(range(10, 10 + n)), 3, create=True)
        steps.append((sid, torch.randn(2, engine.feature_size, generator=rng), [7, 8]))
    return steps


def test_a_draft_batch_takes_features_from_a_fast_path_and_an_inline_step_together(tiny_dir):
    """A fast path's step (features on the transport's device) and an inline fallback step (features
    decoded on the CPU) in one batch: each step's features go to the engine's device before the batch
    concatenates them, and the drafts are those of each session alone."""
    from draft_server.engine import DraftEngine
    from draft_server.steps import _Step

    alone = DraftEngine(tiny_dir / "draft", tiny_dir / "target")
    expected = [list(alone.propose(sid, f, t, 3)) for sid, f, t in _two_sessions(alone, tiny_dir)]
    engine = DraftEngine(tiny_dir / "draft", tiny_dir / "target")
    (a, fa, ta), (b, fb, tb) = _two_sessions(engine, tiny_dir)
    batch = [_Step(engine.sessions.get(a), fa.as_subclass(_OnAnotherDevice), ta, 3),
             _Step(engine.sessions.get(b), fb, tb, 3)]
    assert [list(d) for d in engine._run_batch(batch)] == expected


@pytest.mark.gpu
@requires_cuda
def test_a_cuda_draft_batch_takes_cuda_and_cpu_features_together(tiny_dir):
    """The same on a GPU: one step's features from cuda-ipc or NCCL (on the GPU), one inline (on the CPU)."""
    from draft_server.engine import DraftEngine
    from draft_server.steps import _Step

    alone = DraftEngine(tiny_dir / "draft", tiny_dir / "target", device="cuda")
    expected = [list(alone.propose(sid, f, t, 3)) for sid, f, t in _two_sessions(alone, tiny_dir)]
    engine = DraftEngine(tiny_dir / "draft", tiny_dir / "target", device="cuda")
    (a, fa, ta), (b, fb, tb) = _two_sessions(engine, tiny_dir)
    batch = [_Step(engine.sessions.get(a), fa.cuda(), ta, 3), _Step(engine.sessions.get(b), fb, tb, 3)]
    assert [list(d) for d in engine._run_batch(batch)] == expected


# -- 2. device "cuda" without an index; a transport thread that dies of anything but a RuntimeError -------


@pytest.mark.parametrize("cls", ["TargetSettings", "DraftSettings"])
def test_a_model_service_given_cuda_without_an_index_runs_on_the_current_gpu(tiny_dir, monkeypatch, cls):
    """The compose files set TANDEM_*_DEVICE=cuda; torch.cuda.set_device("cuda") raises (it needs an
    index), so the settings say which GPU: the process's current one (0 here without CUDA)."""
    from tandem import config

    monkeypatch.setenv(f"TANDEM_{cls[:-8].upper()}_DEVICE", "cuda")
    settings = config.load_settings(getattr(config, cls), model=str(tiny_dir / cls[:-8].lower()),
                                    target=str(tiny_dir / "target"))
    index = torch.cuda.current_device() if torch.cuda.is_available() else 0
    assert settings.device == f"cuda:{index}"
    assert config.load_settings(getattr(config, cls), model=str(tiny_dir / cls[:-8].lower()),
                                target=str(tiny_dir / "target"), device="cuda:1").device == "cuda:1"


def test_a_transport_thread_that_fails_says_why_at_once(monkeypatch):
    """Whatever the nccl sender's thread dies of (set_device's ValueError for "cuda" was one) breaks the
    channel with that reason: the handshake is told at once, not after its timeout, and steps go inline."""
    import time

    from tandem.transports import nccl
    from tandem.transports.contract import TransportError
    from tandem.transports.endpoints import TargetTransport
    from tandem.v1 import common_pb2

    def no_group(*args, **kwargs):
        raise ValueError("Expected a torch.device with a specified index or an integer, but got:cuda")

    monkeypatch.setattr(nccl, "_group", no_group)
    target = TargetTransport("nccl", "cpu", "float32", 12, timeout=5.0)
    try:
        plan = target.open(common_pb2.TransportPlan(transport="nccl", reason="test"))
        started = time.monotonic()
        with pytest.raises(TransportError, match="ValueError: Expected a torch.device with a specified index"):
            target.start(plan)
        assert time.monotonic() - started < 2
        assert target.name == "grpc" and target.send("a", torch.randn(2, 12)) is None
    finally:
        target.close()


# -- 3. compose: cuda-ipc only where the draft sees the target's GPU; the next transport on a failed set-up -


def _caps(device: str, uuid: str, visible: list[str], host: str = "boot/ipc:[1]"):
    from tandem.v1 import common_pb2

    return common_pb2.TransportCaps(requested="auto", available=["grpc", "shm", "cuda-ipc", "nccl"], host_id=host,
                                    device=device, device_uuid=uuid, dtype="bfloat16", feature_width=12288,
                                    visible_uuids=visible)


def test_cuda_ipc_is_chosen_only_where_the_draft_can_see_the_targets_gpu():
    """Compose with `ipc: host`: one host, one IPC namespace, but each container sees only its own GPU,
    so the draft cannot map the target's ring. NCCL can cross: auto takes it."""
    from tandem.transports.negotiate import negotiate

    containers = negotiate(_caps("cuda:0", "GPU-a", ["GPU-a"]), _caps("cuda:0", "GPU-b", ["GPU-b"]))
    assert containers.transport == "nccl" and "cannot see the target's GPU GPU-a" in containers.reason
    one_process_view = negotiate(_caps("cuda:0", "GPU-a", ["GPU-a", "GPU-b"]), _caps("cuda:1", "GPU-b", ["GPU-a", "GPU-b"]))
    assert one_process_view.transport == "cuda-ipc"
    from tandem.transports.negotiate import candidates  # what the handshake tries, in order

    assert [c.transport for c in candidates(_caps("cuda:0", "GPU-a", ["GPU-a", "GPU-b"]),
                                            _caps("cuda:1", "GPU-b", ["GPU-a", "GPU-b"]))] == [
        "cuda-ipc", "nccl", "shm", "grpc"]


class _Refused(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str):
        self._code, self._details = code, details

    def code(self):
        return self._code

    def details(self):
        return self._details


class _End:
    """A target's or a draft's transport RPCs, failing for the transports in `fails`; records the calls."""

    def __init__(self, calls: list, name: str, fails: dict[str, str]):
        self.calls, self.name, self.fails = calls, name, fails

    def _call(self, rpc: str, plan):
        self.calls.append((self.name, rpc, plan.transport))
        if plan.transport in self.fails and rpc == "open":
            raise _Refused(grpc.StatusCode.UNAVAILABLE, self.fails[plan.transport])
        return plan

    def OpenTransport(self, plan, timeout=None):
        return self._call("open", plan)

    def StartTransport(self, plan, timeout=None):
        return self._call("start", plan)


def test_a_fast_path_that_fails_to_set_up_makes_way_for_the_next():
    """cuda-ipc chosen, but the draft cannot open the target's handle (IPC not permitted between these
    containers): the handshake tries NCCL next instead of going straight to gRPC."""
    from coordinator.handshake import connect_transport
    from tandem.v1 import draft_pb2, target_pb2

    calls: list = []
    target = _End(calls, "target", {})
    draft = _End(calls, "draft", {"cuda-ipc": "cudaIpcOpenMemHandle: invalid device context"})
    both = ["GPU-a", "GPU-b"]
    used = connect_transport(target, target_pb2.TargetInfo(transport=_caps("cuda:0", "GPU-a", both)),
                             draft, draft_pb2.DraftInfo(transport=_caps("cuda:1", "GPU-b", both)))
    assert used == "nccl"
    assert calls == [("target", "open", "cuda-ipc"), ("draft", "open", "cuda-ipc"),
                     ("target", "open", "nccl"), ("draft", "open", "nccl"), ("target", "start", "nccl")]


def test_falling_back_to_grpc_closes_the_ring_the_target_opened(tmp_path):
    """A plan the target opened (a 256 MiB ring by default) and never started is closed by the next plan,
    grpc included: the shm segment is gone."""
    from pathlib import Path

    from tandem.transports.endpoints import TargetTransport
    from tandem.v1 import common_pb2

    target = TargetTransport("auto", "cpu", "float32", 12, ring_bytes=1 << 20)
    try:
        shm = target.open(common_pb2.TransportPlan(transport="shm", reason="test"))
        segment = Path("/dev/shm") / shm.channel
        assert segment.exists()
        target.open(common_pb2.TransportPlan(transport="grpc", reason="the draft could not attach"))
        assert not segment.exists()
    finally:
        target.close()


# -- 1. NCCL: the group's watchdog out of the way, every wait bounded here, the group aborted on close -----


def _pair(transport: str, timeout: float = 5.0, ring_bytes: int = 1 << 20, device: str = "cpu",
          draft_device: str | None = None):
    """A target's and a draft's transport in this process, set up as the handshake sets them up."""
    import threading

    from tandem.transports.endpoints import DraftTransport, TargetTransport
    from tandem.v1 import common_pb2

    target = TargetTransport(transport, device, "float32", 12, ring_bytes=ring_bytes, max_inflight=8, timeout=timeout)
    draft = DraftTransport(transport, draft_device or device, "float32", 12)
    plan = target.open(common_pb2.TransportPlan(transport=transport, reason="test"))
    attach = threading.Thread(target=draft.open, args=(plan,))  # nccl: both ends join the group at once
    attach.start()
    attach.join(30)
    target.start(plan)
    return target, draft


def _nccl_threads() -> set:
    import threading

    return {t for t in threading.enumerate() if t.name.startswith("tandem-nccl") and t.is_alive()}


def test_an_nccl_channel_idles_past_its_timeout_and_closing_it_ends_both_ends():
    """The draft's receiver is always waiting for the next step; that wait must outlive the transport's
    timeout (NCCL's watchdog killed the process at the group's timeout, 10 s), while closing a channel
    (every re-handshake) ends both threads and aborts the group: none is left behind per handshake.
    Here over gloo, NCCL's code path on the CPU."""
    import time

    before = _nccl_threads()
    for _ in range(2):
        target, draft = _pair("nccl", timeout=1.0)
        time.sleep(1.5)  # idle past the timeout
        features = torch.randn(3, 12)
        assert torch.equal(draft.recv(target.send("a", features), 3, 12), features)
        target.close()
        draft.close()
    deadline = time.monotonic() + 5
    while _nccl_threads() - before:
        assert time.monotonic() < deadline, f"still running after close: {_nccl_threads() - before}"
        time.sleep(0.05)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs two GPUs (it refuses two ranks on one)")
def test_an_nccl_channel_between_two_gpus_idles_past_its_timeout_and_closes():
    """The same with NCCL: before, the watchdog took this process down 2 s into the idle wait."""
    import time

    before = _nccl_threads()
    target, draft = _pair("nccl", timeout=2.0, device="cuda:0", draft_device="cuda:1")
    time.sleep(5)
    features = torch.randn(3, 12, device="cuda:0")
    assert torch.equal(draft.recv(target.send("a", features), 3, 12).cpu(), features.cpu())
    target.close()
    draft.close()
    deadline = time.monotonic() + 15
    while _nccl_threads() - before:
        assert time.monotonic() < deadline, f"still running after close: {_nccl_threads() - before}"
        time.sleep(0.05)


# -- 4. a ring range is reused only once the draft is done with it ------------------------------------------


def test_a_ring_step_stays_readable_until_its_session_is_two_steps_on():
    """With overlap the draft reads a verify's features in the ahead step it runs beside the next verify,
    so the target may send a session's next step before the draft has read the last one. First-fit reuse
    handed the freed range straight back: shm's stamp refused the read ("gone"), cuda-ipc, which has no
    stamp, read the next step's rows. A step is freed once its session is two steps on: the draft has
    answered the step that read it before the coordinator asks for the verify after next."""
    from tandem.transports.contract import TransportError

    target, draft = _pair("shm")
    try:
        first, second, third = torch.randn(5, 12), torch.randn(5, 12), torch.randn(5, 12)
        ref_first = target.send("a", first)
        ref_second = target.send("a", second)  # the next verify finished before the ahead read `first`
        assert torch.equal(draft.recv(ref_first, 5, 12), first)
        target.send("a", third)  # two steps on: the draft answered the step that read `first`
        with pytest.raises(TransportError, match="gone"):
            draft.recv(ref_first, 5, 12)
        assert torch.equal(draft.recv(ref_second, 5, 12), second)
    finally:
        target.close()
        draft.close()


@pytest.mark.gpu
@requires_cuda
def test_cuda_ipc_never_reads_another_steps_rows():
    """The same race on a GPU, where nothing would have noticed it."""
    target, draft = _pair("cuda-ipc", device="cuda")
    try:
        first, second = torch.randn(5, 12, device="cuda"), torch.randn(5, 12, device="cuda")
        ref_first = target.send("a", first)
        ref_second = target.send("a", second)
        assert torch.equal(draft.recv(ref_first, 5, 12), first)
        assert torch.equal(draft.recv(ref_second, 5, 12), second)
    finally:
        target.close()
        draft.close()


# -- 5. the two processes' streams are not coupled -----------------------------------------------------------


def _busy(device: torch.device, seconds: float) -> None:
    """Queue about `seconds` of GPU work on the device's current stream (a forward of the next batch)."""
    import time

    a = torch.randn(2048, 2048, device=device)
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(10):
        a = a @ a / 2048
    torch.cuda.synchronize(device)
    per = (time.perf_counter() - start) / 10
    for _ in range(int(seconds / max(per, 1e-6))):
        a = a @ a / 2048


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("transport", ["cuda-ipc", "nccl"])
def test_a_step_reaches_the_draft_without_waiting_for_the_targets_next_forward(transport):
    """The target's next forward may be queued on its stream before a session thread sends the last
    batch's rows. The rows are copied after the batch's `ready` event on a side stream, so the draft has
    them at once, not a forward later (before: the ring copy, its event and NCCL's header all queued
    behind it, and the draft's stream waited on them)."""
    import time

    if transport == "nccl" and torch.cuda.device_count() < 2:
        pytest.skip("NCCL needs two GPUs")
    device = torch.device("cuda:0")
    target, draft = _pair(transport, device="cuda:0", draft_device="cuda:1" if transport == "nccl" else "cuda:0")
    try:
        features = torch.randn(64, 12, device=device)
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(device))  # the end of the batch that computed them
        _busy(device, 1.0)  # the next batch's forward, queued before the send
        start = time.perf_counter()
        ref = target.send("a", features, ready)
        sent = time.perf_counter() - start
        consumer = torch.cuda.Stream(torch.device(draft.device))  # the draft's own stream, not the target's
        rows = draft.recv(ref, 64, 12, consumer=consumer)  # named, not taken from this thread
        with torch.cuda.stream(consumer):
            copied = rows.to("cpu")
        arrived = time.perf_counter() - start
        assert sent < 0.1 and arrived < 0.5, (sent, arrived)
        assert torch.equal(copied, features.cpu())
    finally:
        torch.cuda.synchronize()
        target.close()
        draft.close()


@pytest.mark.gpu
@requires_cuda
def test_an_inline_steps_features_reach_the_host_without_waiting_for_the_targets_next_forward():
    """Over gRPC the rows go inline: they are copied to the host after the batch's `ready` event on a side
    stream, not behind the next batch's forward on the engine's stream."""
    import time

    from tandem.staging import to_host

    device = torch.device("cuda:0")
    features = torch.randn(64, 12, device=device)
    ready = torch.cuda.Event()
    ready.record(torch.cuda.current_stream(device))
    _busy(device, 1.0)
    start = time.perf_counter()
    (host,) = to_host([features], [ready])
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    assert elapsed < 0.5 and not host.is_cuda, elapsed
    assert torch.equal(host, features.cpu())


# -- 7. the current CUDA device is per thread; a step is timed inside its batch -------------------------------


def test_a_steps_clock_counts_its_batch():
    """A step's compute time is its batch's: the clock runs around the engine's batch (a step waits for no
    other: it runs in the batch it came in)."""
    import time

    from tandem.timing import StepClock

    clock = StepClock()
    with clock.compute():
        time.sleep(0.05)
    assert clock.compute_ns >= 0.05e9 and clock.queue_ns == 0


@pytest.mark.gpu
@requires_cuda
def test_a_steps_compute_time_is_its_batch_on_its_device():
    """StepClock on the engine's device (the last GPU here: a target on cuda:1 timed GPU 0 before): CUDA
    events around the batch, read once the batch has returned its tokens."""
    from tandem.timing import StepClock

    device = torch.device(f"cuda:{torch.cuda.device_count() - 1}")
    x = torch.randn(256, 256, device=device)
    clock = StepClock(device)
    with clock.compute():
        float((x @ x).sum())  # a batch ends synchronised
    assert 0 < clock.compute_ns < 0.2e9


# -- 8. memory: the KV pool at its budget, every other buffer accounted for, RESOURCE_EXHAUSTED not OOM -------


def _pool_tokens(engine) -> int:
    return engine.kv_pool.capacity


def test_the_kv_pool_never_holds_more_than_the_kv_budget(tiny_dir):
    """The pool took 64 blocks whatever the budget and doubled by torch.cat without a cap (3x its size at
    the moment it grew). Now it never passes the budget: preallocated there on a GPU, grown up to it on
    a CPU; reservations count whole blocks, so the budget's sessions always find theirs."""
    from tandem.params import SamplingParams
    from tandem.sessions import ResourceExhausted
    from target_server.engine import TargetEngine

    engine = TargetEngine(tiny_dir / "target", kv_cache_tokens=100)
    assert _pool_tokens(engine) <= 100
    greedy = SamplingParams()
    token = engine.prefill("a", [5] * 30, greedy, max_new_tokens=30).token  # 30 + 17 = 47: 48 in blocks
    engine.prefill("b", [5] * 3, greedy, max_new_tokens=1)  # 3 + 17 = 20: 32
    assert engine.kv_budget.used == 80
    with pytest.raises(ResourceExhausted, match="budget is taken"):  # 3 + 17 = 20: 32 in blocks, 112 > 100
        engine.prefill("c", [5] * 3, greedy, max_new_tokens=30)
    engine.release("b")
    for _ in range(6):  # a grows, up to 30 + 24 + 17 = 71: 80 in blocks
        token = engine.verify("a", token, [8, 9, 10]).bonus
    assert 48 <= engine.kv_budget.used <= 80
    assert _pool_tokens(engine) <= 100
    engine.release("a")
    assert engine.kv_budget.used == 0 and _pool_tokens(engine) <= 100


def test_a_forward_gathers_no_more_kv_than_the_budget_holds(tiny_dir):
    """A batch gathers its sessions' KV, each padded to the longest: one long session among many short
    ones made a copy many times what they hold. A batch whose padded copy would pass the budget runs in
    several forwards, each within it, and the tokens are those of each session alone."""
    from tandem.params import SamplingParams
    from target_server.engine import TargetEngine
    from target_server.steps import Step

    greedy = SamplingParams()
    prompts = {"long": list(range(3, 103)), **{f"s{i}": [4 + i, 9, 2] for i in range(6)}}
    alone = TargetEngine(tiny_dir / "target", kv_cache_tokens=320, engine="hf")  # the gather is transformers' path
    expected = {}
    for sid, prompt in prompts.items():
        token = alone.prefill(sid, prompt, greedy, max_new_tokens=4).token
        expected[sid] = alone.verify(sid, token, [11, 12, 13]).accepted
    engine = TargetEngine(tiny_dir / "target", kv_cache_tokens=320, engine="hf")
    first = {sid: engine.prefill(sid, prompt, greedy, max_new_tokens=4).token for sid, prompt in prompts.items()}
    gathered = []
    hook = engine.runner.decoder.register_forward_pre_hook(
        lambda module, args, kwargs: gathered.append(
            kwargs["input_ids"].shape[0] * (kwargs["past_key_values"].get_seq_length() + kwargs["input_ids"].shape[1])),
        with_kwargs=True)
    try:
        steps = [Step("verify", engine.sessions.get(sid), [first[sid], 11, 12, 13], False) for sid in prompts]
        results = engine._run_batch(steps)
    finally:
        hook.remove()
    assert {sid: r.accepted for sid, r in zip(prompts, results, strict=True)} == expected
    assert max(gathered) <= 320, gathered  # 7 x (100 + 4) = 728 in one forward before


def test_a_forward_that_runs_out_of_memory_is_refused_and_the_engine_goes_on(tiny_dir):
    """The last line: an out-of-memory error in a forward fails that batch's steps with
    RESOURCE_EXHAUSTED (a full server), not INTERNAL, and the next batch runs."""
    from tandem.params import SamplingParams
    from tandem.sessions import ResourceExhausted
    from target_server.engine import TargetEngine

    engine = TargetEngine(tiny_dir / "target", kv_cache_tokens=200)
    token = engine.prefill("a", [5, 6, 7], SamplingParams(), max_new_tokens=20).token

    def oom(module, args, kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    hook = engine.model.register_forward_pre_hook(oom, with_kwargs=True)
    with pytest.raises(ResourceExhausted, match="out of memory"):
        engine.verify("a", token, [8, 9])
    hook.remove()
    assert len(engine.verify("a", token, [8, 9]).accepted) <= 2


def test_the_default_kv_budget_leaves_room_for_the_ring_a_forward_and_the_gather():
    """The budget was 80% of the memory free after loading; the ring came after it, and a forward's
    activations and its gathered KV were not counted. Now: pool + gather workspace + ring + the measured
    forward + a margin fit in what is free."""
    from target_server.engine import kv_budget_tokens

    gib = 1 << 30
    per_token, layers = 128 << 10, 32  # an 8B Llama in bf16: 2 * 32 layers * 8 heads * 128 * 2 bytes
    free, total, ring, forward = 60 * gib, 80 * gib, 256 << 20, 3 * gib
    tokens = kv_budget_tokens(free, total, per_token, layers, ring_bytes=ring, forward_bytes=forward)
    gather = 2 * tokens * per_token // layers  # one layer's padded past and its gathered copy
    assert tokens * per_token + gather + ring + forward <= free - 0.05 * total
    assert tokens * per_token > 0.8 * (free - ring - forward - 0.05 * total)  # and not much less
    assert kv_budget_tokens(2 * gib, total, per_token, layers, ring_bytes=ring, forward_bytes=forward) == 0


def test_one_gpu_for_both_is_split_between_the_target_and_the_draft_whichever_loads_first():
    """Each sized its KV from what was free when it loaded: the first counted the other's memory as its own.
    On one GPU each now counts its part of the total less what it holds; alone, what is free, as before."""
    from tandem.memory import DRAFT_GPU_SHARE, gpu_headroom, gpu_part, shares_gpu

    gib = 1 << 30
    total, target_weights, draft_weights = 80 * gib, 16 * gib, 2 * gib
    target_part, draft_part = gpu_part("target", True), gpu_part("draft", True)
    assert (target_part, draft_part) == (1 - DRAFT_GPU_SHARE, DRAFT_GPU_SHARE)
    for target_first in (True, False):
        # the first to load sees the other's weights (or not), never the other's KV
        free = total - target_weights - (0 if target_first else draft_weights + int(draft_part * total) // 2)
        target = gpu_headroom(free, total, target_weights, target_part)
        assert target == int(target_part * total) - target_weights  # the draft's part left out, though free now
        free = total - target_weights - target - draft_weights  # the target's pool taken
        draft = gpu_headroom(free, total, draft_weights, draft_part)
        assert draft == int(draft_part * total) - draft_weights
        assert target_weights + target + draft_weights + draft <= total
    # never more than is free (the other over its part while it loads), nothing when the weights fill the part
    assert gpu_headroom(3 * gib, total, draft_weights, draft_part) == 3 * gib
    assert gpu_headroom(60 * gib, total, 11 * gib, draft_part) == 0
    assert gpu_headroom(60 * gib, total, target_weights, gpu_part("target", False)) == 60 * gib  # alone
    assert shares_gpu("cuda:0", "cuda") and shares_gpu("cuda:1", "cuda:1")
    assert not shares_gpu("cuda:0", "cuda:1") and not shares_gpu("cpu", "cpu") and not shares_gpu("cuda:0", "cpu")


def test_a_target_on_a_gpu_it_shares_leaves_the_drafts_part_out_and_refuses_when_its_own_cannot_hold_it(
        tiny_dir, monkeypatch):
    """The target's budget on one GPU with the draft: its part less its weights, though the draft's is free."""
    import types

    from tandem.config import TargetSettings
    from tandem.memory import DRAFT_GPU_SHARE
    from tandem.service import StartupError
    from target_server.engine import kv_budget_tokens
    from target_server.service import kv_tokens

    gib = 1 << 30
    per_token, layers, forward, total = 128 << 10, 32, 3 * gib, 80 * gib
    engine = types.SimpleNamespace(device=torch.device("cuda:0"), kv_bytes_per_token=per_token, num_layers=layers,
                                   measure_forward_bytes=lambda: forward, gather_bytes_per_token=0)
    weights = {"bytes": 16 * gib}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (total - weights["bytes"], total))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: weights["bytes"])
    alone = TargetSettings(model=tiny_dir / "target", transport="grpc")
    shared = alone.model_copy(update={"shared_gpu": True})
    assert kv_tokens(alone, engine) == kv_budget_tokens(64 * gib, total, per_token, layers, forward_bytes=forward)
    headroom = int((1 - DRAFT_GPU_SHARE) * total) - 16 * gib
    assert kv_tokens(shared, engine) == kv_budget_tokens(headroom, total, per_token, layers, forward_bytes=forward)
    weights["bytes"] = 66 * gib  # past its 70 GiB once a forward and the margin are counted
    with pytest.raises(StartupError, match=r"its 87.5% of the GPU it shares with the draft, 70.00 GiB, less the "
                                           r"66.00 GiB it holds; a forward takes 3.00"):
        kv_tokens(shared, engine)
    assert kv_tokens(alone, engine) > 0  # alone, the same weights leave room


def test_the_draft_kv_budget_on_a_gpu_counts_a_propose_and_refuses_a_start_that_cannot_hold_it():
    """The draft had no budget: its KV grew until the GPU ran out. On a GPU its budget is what its headroom
    holds less a margin and a measured propose, each token with the batch's copies of it; a start where nothing
    fits, or less than --kv-cache-gib asks, is refused naming the figures."""
    from draft_server.budget import KV_COPIES, draft_kv_budget_tokens, gpu_kv_tokens
    from tandem.service import StartupError

    gib = 1 << 30
    per_token, working, total = 4 << 10, gib, 80 * gib  # an 8B Llama's head in bf16: 2 * 8 heads * 128 * 2 bytes
    tokens = draft_kv_budget_tokens(20 * gib, total, per_token, working)
    assert tokens * per_token * KV_COPIES + working + 0.05 * total <= 20 * gib
    assert tokens * per_token * KV_COPIES > 0.99 * (20 * gib - working - 0.05 * total)
    # alone on its GPU: what is free; on one shared with the target: its part less its weights
    assert gpu_kv_tokens(20 * gib, total, 2 * gib, per_token, working, shared=False) == tokens
    shared = gpu_kv_tokens(60 * gib, total, 2 * gib, per_token, working, shared=True)
    assert shared == draft_kv_budget_tokens(8 * gib, total, per_token, working)
    assert gpu_kv_tokens(60 * gib, total, 2 * gib, per_token, working, shared=True, asked=1000) == 1000
    with pytest.raises(StartupError, match=r"12.5% of the GPU it shares with the target, 10.00 GiB, less the 9.50 GiB "
                                           r"it holds; a propose takes 1.00 GiB.*room for 0 tokens"):
        gpu_kv_tokens(60 * gib, total, int(9.5 * gib), per_token, working, shared=True)
    with pytest.raises(StartupError, match=rf"room for {shared} tokens, --kv-cache-gib asks for {shared + 1}"):
        gpu_kv_tokens(60 * gib, total, 2 * gib, per_token, working, shared=True, asked=shared + 1)


def test_serve_tells_the_target_and_the_draft_they_share_a_gpu_by_a_variable_with_no_flag(tiny_dir, monkeypatch):
    from tandem.config import NO_FLAG, DraftSettings, TargetSettings, load_settings
    from tandem_tools.serve import child_env, shared_gpu

    assert "shared_gpu" in NO_FLAG
    assert shared_gpu("cuda:0", "cpu") is None and shared_gpu("cuda", None) is None
    assert child_env("draft", shared_gpu=shared_gpu("cuda:1", "cuda:0")) == {}  # two GPUs: each has its own
    target = str(tiny_dir / "target")
    assert not load_settings(TargetSettings, model=target).shared_gpu
    env = {**child_env("target", shared_gpu=shared_gpu("cuda", "cuda:0")),
           **child_env("draft", shared_gpu=shared_gpu("cuda", "cuda:0"))}
    assert env == {"TANDEM_TARGET_SHARED_GPU": "1", "TANDEM_DRAFT_SHARED_GPU": "1"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert load_settings(TargetSettings, model=target).shared_gpu
    assert load_settings(DraftSettings, model=str(tiny_dir / "draft"), target=target).shared_gpu


@pytest.mark.gpu
@requires_cuda
def test_a_gpu_targets_kv_pool_is_preallocated_at_its_budget(tiny_dir):
    from tandem.params import SamplingParams
    from target_server.engine import TargetEngine

    engine = TargetEngine(tiny_dir / "target", device="cuda", kv_cache_tokens=1000)
    blocks = engine.kv_pool.blocks
    assert engine.kv_pool.capacity == 1000 // engine.kv_pool.BLOCK * engine.kv_pool.BLOCK
    before = torch.cuda.memory_reserved()
    token = engine.prefill("a", list(range(3, 300)), SamplingParams(), max_new_tokens=100).token
    for _ in range(20):
        token = engine.verify("a", token, [8, 9, 10]).bonus
    assert engine.kv_pool.blocks == blocks
    assert torch.cuda.memory_reserved() - before < 64 << 20  # no growth of the pool, only activations
