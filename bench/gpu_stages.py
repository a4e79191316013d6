"""bench/gpu_validate.py's model stages: the target's forward and the head's rollout at Llama-3.1-8B's shape,
random weights built in bfloat16 in memory (nothing saved, no float32 copy), timed eager, compiled and
replayed as CUDA graphs, with kernels and host syncs per call.

Kernels: on CUDA the device activities torch's profiler records in one call; on a CPU the ATen ops
tandem_tools/opcount.py counts. Host syncs: on CUDA what torch's sync debug mode warns about in one call
(every sync torch itself makes); on a CPU opcount's count of the syncs a GPU would make.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable

import torch


def _build(make: Callable[[], torch.nn.Module], device: torch.device) -> torch.nn.Module:
    """A module made on `device` in bfloat16 from the start (its own random init; no float32 copy)."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            return make().eval().requires_grad_(False)
    finally:
        torch.set_default_dtype(default)


def _time(call: Callable[[], object], device: torch.device, reps: int) -> float:
    """ms per call, after one untimed call."""
    call()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            call()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / reps
    begun = time.perf_counter()
    for _ in range(reps):
        call()
    return (time.perf_counter() - begun) * 1e3 / reps


def _counts(call: Callable[[], object], device: torch.device, traced: bool = False) -> tuple[int | None, int | None]:
    """(kernels, host syncs) of one call; None where not counted (a compiled call on a CPU: its ops are the
    graph's, and a dispatch mode would be traced into it)."""
    if device.type == "cuda":
        from torch.profiler import ProfilerActivity, profile

        torch.cuda.synchronize(device)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            call()
            torch.cuda.synchronize(device)
        kernels = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
        torch.cuda.synchronize(device)
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                call()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        return kernels, sum("synchroniz" in str(w.message) for w in caught)
    if traced:
        return None, None
    from tandem_tools.opcount import OpCounter

    with OpCounter() as ops:
        call()
    return ops.ops, ops.syncs


def _bandwidth(device: torch.device) -> float:
    """Bytes per second a device-to-device copy moves (read and written), the weight-read floor's rate."""
    if device.type != "cuda":
        return float("nan")
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = _time(lambda: dst.copy_(src), device, 10)
    return 2 * (1 << 30) / (ms / 1e3)


def _config(sizes):
    from transformers import LlamaConfig

    return LlamaConfig(**sizes.shape, rope_theta=500000.0, tie_word_embeddings=False, bos_token_id=0,
                       eos_token_id=1, architectures=["LlamaForCausalLM"])


def forward(sizes, record, pair) -> None:
    from tandem.compiling import compile_graphs
    from tandem.pairing import default_aux_layer_ids
    from target_server.native import NativeCausalLM, rope_frequencies
    from target_server.paged import Span, bucket
    from target_server.runners import NativeRunner

    device, dtype = torch.device(sizes.device), torch.bfloat16
    torch.manual_seed(0)
    begun = time.monotonic()
    config = _config(sizes)
    model = _build(lambda: NativeCausalLM(config, default_aux_layer_ids(config.num_hidden_layers)), device)
    model.inv_freq = rope_frequencies(config)[0].to(device)  # float32, as load_native keeps it
    runner = NativeRunner(model, device, compile=False)  # eager: q/k/v and gate/up fused; the compiled shares it
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    rate = _bandwidth(device)
    floor = weights / rate * 1e3
    record("build", "PASS", f"{weights / 1e9:.2f} GB of bfloat16 weights in {time.monotonic() - begun:.1f} s; "
           f"copy rate {rate / 1e12:.2f} TB/s, weight-read floor {floor:.2f} ms", weights=weights, floor_ms=floor)
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = config.hidden_size // heads
    sessions = 16
    pool = runner.make_pool(config.num_hidden_layers, kv_heads, head_dim, dtype, sessions * (sizes.past + 128))
    blocks = -(-(sizes.past + 128) // pool.BLOCK)
    owned = [(1 + i, pool.allocate(blocks)) for i in range(sessions)]
    with torch.inference_mode():  # the sessions' past, written once
        runner._run([1] * (sizes.past * sessions), [Span(o, b, 0, sizes.past) for o, b in owned],
                    (0, 0), pool, False)

    def spans(n: int) -> list[Span]:
        per, count = (n, 1) if n <= 6 else (n // sessions, sessions)
        return [Span(o, b, sizes.past, per) for o, b in owned[:count]]

    def measure(mode: str, n: int, call: Callable[[], object], traced: bool = False, note: str = "") -> None:
        ms = _time(call, device, sizes.reps)
        kernels, syncs = _counts(call, device, traced)
        record(f"{mode} {n} tokens", "FAIL" if note else "PASS", f"{ms:.2f} ms ({ms / floor:.2f}x the floor), "
               f"kernels {kernels}, syncs {syncs}{note}", ms=ms, floor_ms=floor, kernels=kernels, syncs=syncs)

    def step(n: int, compiled: bool) -> Callable[[], object]:
        ids, layout = [3] * n, spans(n)
        key = (bucket(n, device.type), pool.owner.shape[0])
        return lambda: model.lm_head(runner._run(ids, layout, key, pool, compiled)[0][:n])

    with torch.inference_mode():
        for n in sizes.widths:
            if record.left() < 20:
                record(f"eager {n} tokens", "SKIP", "the stage's cap")
                continue
            measure("eager", n, step(n, False))
        backend = "eager" if sizes.dry else "inductor"  # a dry run checks the path, not inductor's CPU build
        runner._forward = compile_graphs(model, 64, fullgraph=True, dynamic=False, backend=backend)
        runner.compiled = True
        for n in sizes.compiled_widths:
            if record.left() < 50:  # a bucket of the 8B shape compiles in about 40 s
                record(f"compiled {n} tokens", "SKIP", "the stage's cap")
                continue
            started = time.monotonic()
            try:
                call = step(n, True)
                call()
                record(f"compile {n} tokens", "INFO", f"{time.monotonic() - started:.1f} s",
                       compile_s=time.monotonic() - started)
                measure("compiled", n, call, traced=True)
            except Exception as exc:  # noqa: BLE001 - the table says what broke
                record(f"compiled {n} tokens", "FAIL", f"{type(exc).__name__}: {str(exc)[:300]}")
                continue
            _graph_of(record, measure, n, runner, step, device)


def _graph_of(record, measure, n: int, runner, step, device: torch.device) -> None:
    """The runner's own CUDA graph of the bucket (target_server/graphs.py): the first call captures it over
    the bucket's static inputs, each later one writes the step's tables there (one copy) and replays."""
    from target_server.graphs import CudaGraphs

    if device.type != "cuda":
        record(f"graph {n} tokens", "SKIP", "CUDA graphs need CUDA")
        return
    compiled = step(n, True)()
    runner.graphs = CudaGraphs(runner._forward, device)
    try:
        call = step(n, True)
        call()  # captures
        same = torch.equal(call(), compiled)
        measure("graph", n, call, note="" if same else "; logits NOT as compiled")
    except Exception as exc:  # noqa: BLE001
        record(f"graph {n} tokens", "FAIL", f"{type(exc).__name__}: {str(exc)[:300]}")
    finally:
        runner.graphs = None


def rollout(sizes, record, pair) -> None:
    from draft_server.model import Eagle3Draft
    from tandem_tools.tiny import tiny_draft_config

    device = torch.device(sizes.device)
    torch.manual_seed(0)
    config = _config(sizes)
    head = _build(lambda: Eagle3Draft(tiny_draft_config(config, sizes.draft_vocab)), device)
    with torch.no_grad():
        head.d2t.zero_()
        head.t2d.fill_(True)
    with torch.device(device):  # RoPE's tables in float32, as load_draft keeps them
        head.rotary_emb = type(head.rotary_emb)(head.config.layer)
    with torch.inference_mode():
        for b in sizes.batches:
            _rollout_at(sizes, record, head, config, b, device)


def _rollout_at(sizes, record, head, config, b: int, device: torch.device) -> None:
    """The K-step rollout of a batch of b rows over a past of sizes.past pairs in the draft's batch buffers
    (draft_server/batch.py), eager, then as the draft's own graph of its bucket (draft_server/graphs.py)."""
    from draft_server.batch import BatchBuffers
    from draft_server.graphs import RolloutGraphs
    from draft_server.model import DraftKV
    from draft_server.rollout import rollout as roll

    past, dtype = sizes.past, torch.bfloat16
    buffers = BatchBuffers(head, device, dtype)
    stores, valid = buffers.take(b, past + sizes.k - 1)
    valid.fill_(True)
    for k, v in stores:
        k.normal_()
        v.normal_()
    kv = DraftKV.over(stores, past)
    a = torch.randn(b, 1, config.hidden_size, device=device, dtype=dtype)
    position = torch.full((b, 1), past, device=device)

    def call() -> torch.Tensor:
        kv.crop(past)
        return roll(head, 0, a, kv, position, sizes.k, None, valid)[0]  # drafts [b, K]

    ms = _time(call, device, sizes.reps)
    kernels, syncs = _counts(call, device)
    record(f"eager K={sizes.k} batch {b}", "PASS", f"{ms:.2f} ms, kernels {kernels}, syncs {syncs}",
           ms=ms, kernels=kernels, syncs=syncs)
    if device.type != "cuda":
        record(f"graph K={sizes.k} batch {b}", "SKIP", "CUDA graphs need CUDA")
        return
    try:
        expected = call().clone()
        graphs = RolloutGraphs(head, buffers, device)

        def replay() -> torch.Tensor:
            kv.crop(past)
            return graphs.rollout(a, kv, position, sizes.k, valid)[0]

        same = torch.equal(replay(), expected)  # the first call captures the bucket
        ms = _time(replay, device, sizes.reps)
        kernels, syncs = _counts(replay, device)
        record(f"graph K={sizes.k} batch {b}", "PASS" if same else "FAIL",
               f"{ms:.2f} ms, kernels {kernels}, syncs {syncs}; drafts {'as' if same else 'NOT as'} eager",
               ms=ms, kernels=kernels, syncs=syncs)
    except Exception as exc:  # noqa: BLE001
        record(f"graph K={sizes.k} batch {b}", "FAIL", f"{type(exc).__name__}: {str(exc)[:300]}")
