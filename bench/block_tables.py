"""What planning a forward costs on the host as the KV pool grows: the BlockMask's tables as wide as the pool
against as wide as one query block's sequences (PagedKVPool.table_columns), for 16 decodes, 16 verifies of 6
tokens and one verify of 6, each session 300 tokens in.

    python bench/block_tables.py [--context 8192] [--repeats 50]

Prints, per pool size (blocks), the median ms of `plan_with` into a bucket's static buffer both ways. On this
machine a query block is one token (paged.Q_BLOCK); a GPU's is 16, so its tables have 16x fewer rows.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tandem.staging import Staged
from target_server.paged import BLOCK, PagedKVPool, Span, bucket, plan_with


def plan_ms(pool: PagedKVPool, sessions: int, new: int, repeats: int) -> float:
    held = 310 // BLOCK + 1
    spans = [Span(i, list(range(1 + held * i, 1 + held * (i + 1))), 300, new) for i in range(sessions)]
    width, staged = bucket(sessions * new), Staged(pool.device)
    times = []
    for i in range(repeats + 3):
        started = time.perf_counter()
        plan_with(spans, width, pool, False, (), staged)
        if i >= 3:
            times.append(time.perf_counter() - started)
    return 1e3 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=8192, help="the target's context (tokens)")
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    torch.set_num_threads(1)
    shapes = [(16, 1), (16, 6), (1, 6)]
    print("blocks  " + "  ".join(f"{s}x{n} pool / seq (ms)" for s, n in shapes))
    for blocks in (64, 1024, 16384, 65536):
        cells = []
        for sessions, new in shapes:
            wide, narrow = (plan_ms(PagedKVPool(1, 1, 8, torch.float32, torch.device("cpu"), blocks=blocks,
                                                sequence_blocks=bound), sessions, new, args.repeats)
                            for bound in (None, -(-args.context // BLOCK)))
            cells.append(f"{wide:8.3f} / {narrow:6.3f}     ")
        print(f"{blocks:6d}  " + "  ".join(cells))


if __name__ == "__main__":
    main()
