"""The draft's batched propose on its own: B sessions of a given context, K drafts each, a few new pairs a round,
through DraftEngine.run as the draft service runs a step. A random head of SmolLM2-135M's shape (the README
demo's target) by default, float32, one thread.

    python bench/draft_batch.py [--batches 1,16] [--contexts 256,1024] [--k 5] [--rounds 30] [--shape smollm2|demo]

Prints per (batch, context) the median ms of a step over `rounds`.
Run it in two checkouts to compare two versions of the engine: the script uses only DraftEngine's public run().
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from transformers import LlamaConfig

from draft_server.checkpoint import save_draft
from draft_server.engine import DraftEngine
from draft_server.layouts import REFERENCE
from draft_server.model import Eagle3Draft
from tandem.protocol import Propose
from tandem_tools.tiny import tiny_draft_config

SHAPES = {  # the target's shape the head is built for (tiny_draft_config copies its layer)
    "smollm2": {"vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9,
                "num_key_value_heads": 3, "num_hidden_layers": 30, "max_position_embeddings": 8192},
    "demo": {"vocab_size": 2048, "hidden_size": 192, "intermediate_size": 512, "num_attention_heads": 3,
             "num_key_value_heads": 1, "num_hidden_layers": 8, "max_position_embeddings": 4096},
}


def build(directory: Path, shape: str) -> DraftEngine:
    torch.manual_seed(0)
    target = LlamaConfig(**SHAPES[shape], tie_word_embeddings=False, bos_token_id=0, eos_token_id=1)
    head = Eagle3Draft(tiny_draft_config(target, min(32000, target.vocab_size)))
    save_draft(head, directory, layout=REFERENCE, include_embeddings=True)
    return DraftEngine(directory)


def step_ms(engine: DraftEngine, batch: int, context: int, k: int, rounds: int) -> float:
    g = torch.Generator().manual_seed(batch * 7 + context)
    names = [f"s{batch}-{context}-{i}" for i in range(batch)]

    def pairs(m: int) -> tuple[torch.Tensor, list[int]]:
        return torch.randn(m, engine.feature_size, generator=g), torch.randint(2, 1000, (m,), generator=g).tolist()

    engine.run([Propose(name, *pairs(context), k, True) for name in names])
    times = []
    for r in range(rounds + 3):
        steps = [Propose(name, *pairs(1 + (r + i) % 3), k) for i, name in enumerate(names)]
        begun = time.perf_counter()
        results = engine.run(steps)
        times.append((time.perf_counter() - begun) * 1e3)
        assert not any(isinstance(x, Exception) for x in results), results
    for name in names:
        engine.release(name)
    return statistics.median(times[3:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--contexts", default="256,1024")
    parser.add_argument("--k", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        engine = build(Path(tmp) / "head", args.shape)
        for batch in map(int, args.batches.split(",")):
            for context in map(int, args.contexts.split(",")):
                ms = step_ms(engine, batch, context, args.k, args.rounds)
                print(f"batch {batch:3d}  context {context:5d}  K={args.k}: {ms:7.2f} ms a step", flush=True)


if __name__ == "__main__":
    main()
