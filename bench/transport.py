"""Per-transport latency and bandwidth of one feature step, target process -> draft process.

    python bench/transport.py                  # every transport this machine can run
    python bench/transport.py --iters 50 --transports shm,nccl

The draft is a child process. Each step: the target sends [n, W] features, the descriptor (or, for
grpc, the serialized chunks) goes to the child over a pipe standing in for the coordinator, the
child receives the rows and answers; the figure is the median round. grpc here is the codec and one
pipe hop: the real path adds gRPC framing and the coordinator's second hop, so it is a lower bound.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time

SIZES = [(3 * 4096, "bfloat16", n) for n in (1, 8, 64, 4096)] + [(3 * 64, "float32", n) for n in (1, 8, 64, 4096)]


def _draft(conn, plan_bytes: bytes, device: str) -> None:
    import torch

    from tandem.transports.endpoints import open_receiver
    from tandem.v1 import common_pb2
    from tandem.wire import decode_features

    torch.set_num_threads(1)
    plan = common_pb2.TransportPlan.FromString(plan_bytes)
    receiver = open_receiver(plan, device, None)
    conn.send("ready")
    while (data := conn.recv_bytes()) != b"":
        if plan.transport == "grpc":
            step = common_pb2.FeatureRef()  # unused: inline chunks follow
            chunks = [common_pb2.Features.FromString(c) for c in _split(data)]
            decode_features(chunks)
        else:
            step = common_pb2.FeatureRef.FromString(data)
            receiver.recv(step)
        conn.send_bytes(b"1")
    if receiver is not None:
        receiver.close()


def _join(chunks: list[bytes]) -> bytes:
    return b"".join(len(c).to_bytes(8, "little") + c for c in chunks)


def _split(data: bytes) -> list[bytes]:
    out, i = [], 0
    while i < len(data):
        n = int.from_bytes(data[i : i + 8], "little")
        out.append(data[i + 8 : i + 8 + n])
        i += 8 + n
    return out


def bench(transport: str, device: str, iters: int) -> list[tuple] | str:
    import torch

    from tandem.transports.caps import available
    from tandem.transports.contract import TransportError
    from tandem.transports.endpoints import TargetTransport
    from tandem.v1 import common_pb2
    from tandem.wire import encode_features

    if transport not in available(device):
        return f"unavailable on {device}"
    sender = TargetTransport(transport, device, "float32", 0, ring_bytes=256 << 20, max_inflight=8, timeout=30)
    plan = sender.open(common_pb2.TransportPlan(transport=transport, reason="bench"))
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    # NCCL refuses two ranks on one GPU: the draft takes the second one
    two_gpus = transport == "nccl" and device.startswith("cuda") and torch.cuda.device_count() > 1
    proc = ctx.Process(target=_draft, args=(child, plan.SerializeToString(), "cuda:1" if two_gpus else device),
                       daemon=True)
    proc.start()
    rows = []
    try:
        if transport != "grpc":
            sender.start(plan)
        assert parent.recv() == "ready"
        for width, dtype, n in SIZES:
            features = torch.randn(n, width).to(getattr(torch, dtype)).to(device)
            times = []
            for i in range(iters + 2):
                start = time.perf_counter()
                ref = sender.send("bench", features)
                if ref is None:
                    if transport != "grpc":
                        raise TransportError(f"{transport} took the step inline (ring full?)")
                    parent.send_bytes(_join([c.SerializeToString() for c in encode_features(features)]))
                else:
                    parent.send_bytes(ref.SerializeToString())
                parent.recv_bytes()
                if i >= 2:  # the first rounds warm up allocators and caches
                    times.append(time.perf_counter() - start)
            median = statistics.median(times)
            nbytes = features.numel() * features.element_size()
            rows.append((f"3x{width // 3} {dtype}", n, nbytes, median * 1e6, nbytes / median / 1e9))
        parent.send_bytes(b"")
        proc.join(30)
    finally:
        sender.close()
        if proc.is_alive():
            proc.kill()
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--transports", default="grpc,shm,nccl,cuda-ipc")
    p.add_argument("--device", default=None, help="cuda when available, else cpu")
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    print(f"device {device}; median of {args.iters} steps, target process -> draft process\n")
    print("| transport | features | tokens | bytes | latency (us) | bandwidth (GB/s) |")
    print("|---|---|---:|---:|---:|---:|")
    for transport in args.transports.split(","):
        result = bench(transport, device, args.iters)
        if isinstance(result, str):
            print(f"| {transport} | {result} | | | | |")
            continue
        for features, n, nbytes, micros, gbps in result:
            print(f"| {transport} | {features} | {n} | {nbytes} | {micros:.0f} | {gbps:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
