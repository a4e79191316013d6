"""Plain next-token training of a small LM on this machine's CPUs (the demo's target and assistant), and the
torch thread count to train with, which the SmolLM2 build uses too.
"""

from __future__ import annotations

import math
import os
import sys
import time

# no torch at import: tandem_tools.demo imports this, and `tandem` registers that module's subcommand


def pick_threads() -> int:
    """All cores, unless the machine is busy: then torch's thread pool waits on descheduled workers and one
    thread is faster, many times over. A 0.1 s probe of each decides."""
    import torch

    cores = os.cpu_count() or 1
    if cores == 1:
        return 1
    a, b = torch.randn(1024, 256), torch.randn(256, 688)
    timings = {}
    for n in (cores, 1):
        torch.set_num_threads(n)
        a @ b  # warm the pool
        t0 = time.perf_counter()
        for _ in range(20):
            a @ b
        timings[n] = time.perf_counter() - t0
    return min(timings, key=timings.get)


def train_lm(
    model,
    stream,  # [N] token ids
    *,
    steps: int,
    batch_size: int,
    seq_len: int,
    lr: float,
    seed: int,
    desc: str,
    progress: bool = True,
    threads: int | None = None,
) -> list[float]:
    """Next-token training on random windows of the stream; AdamW, warm-up then cosine to lr/10.
    threads: torch threads; None re-picks them every 25 steps (pick_threads)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, min(30, steps // 10))
    model.train()
    losses: list[float] = []
    bar = _bar(steps, desc, progress)
    for step in range(steps):
        if step % 25 == 0 and threads is None:  # the load of a shared machine changes: look again
            torch.set_num_threads(pick_threads())
        scale = min(1.0, (step + 1) / warmup) * (0.1 + 0.45 * (1 + math.cos(math.pi * step / steps)))
        for group in optimizer.param_groups:
            group["lr"] = lr * scale
        starts = torch.randint(0, stream.numel() - seq_len - 1, (batch_size,), generator=generator)
        ids = torch.stack([stream[s : s + seq_len] for s in starts.tolist()])  # [B, T]
        loss = model(input_ids=ids, labels=ids).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{sum(losses[-10:]) / len(losses[-10:]):.3f}")
    if bar is not None:
        bar.close()
    model.eval()
    return losses


def _bar(total: int, desc: str, progress: bool):
    if not progress:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="step", file=sys.stderr, dynamic_ncols=True)
