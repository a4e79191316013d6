"""The engine profile: what one round asks of the device, for the old target engine (transformers'
forward over a gathered, padded past: engine="hf") and the new one (the native model over the paged pool
in place: engine="native", eager and compiled), side by side, at batch 1 and 16 on the demo pair.

    python bench/engine_profile.py [--json PATH] [--rounds 10] [--k 4] [--batches 1,16] [--speed]

Per round (one batched verify of B sessions on the target, one batched propose of B sessions on the draft):
  ops_per_layer            ATen ops the target's batch launches (tandem_tools/opcount.py), over its layers; for
                           the compiled engine the graph's kernels (inductor's generated and extern kernels) plus
                           the ops outside it
  syncs_per_verify         host syncs of the target's batch, per verify (the batch's syncs / B)
  syncs_per_rollout        host syncs of the draft's batched propose (draft_server/engine.py as it is), per session
  kv_bytes_copied_per_forward  KV moved besides writing the new tokens: old, the gather of every layer's padded past
                           (a temporary from the pool, then into the padded buffer), the new tokens put after it
                           and the committed rows scattered back (selected by a mask, then written); new: none
  kv_bytes_written_per_forward the new tokens' KV written into the pool (new engine; the old one's scatter is above)
  recompiles_after_warmup  graphs dynamo compiled after the warm-up rounds (torch._dynamo counters)
  target_ms, draft_ms      median ms of the target's batch and of the draft's batch
--speed adds tokens/s of one in-process generation at a time (InProcessGenerator, draft_cost 0, greedy, 64
tokens, the demo prompts, K=4) for each engine: the median of 3 passes after an untimed one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch._inductor.metrics as inductor_metrics
from torch._dynamo.utils import counters
from torch.utils._python_dispatch import _disable_current_modes

from draft_server.engine import DraftEngine
from draft_server.steps import _Step as DraftStep
from tandem.params import GenerationRequest, SamplingParams
from tandem_tools.demo import ensure_demo, load_prompts
from tandem_tools.inprocess import InProcessGenerator
from tandem_tools.opcount import OpCounter
from target_server.engine import TargetEngine
from target_server.steps import Step

ENGINES = {"hf": ("hf", False), "native-eager": ("native", False), "native-compiled": ("native", True)}


def graph_kernels() -> int:
    """Kernels inductor has generated so far, and the extern (ATen) calls and templates of its graphs."""
    inductor = counters["inductor"]
    return (inductor_metrics.generated_kernel_count + inductor["extern_calls"]
            + inductor["cpp_templated_kernel_counter"])


class Pair:
    """B sessions of the demo pair, prefilled and drafted, advanced round by round with batched steps."""

    def __init__(self, target: TargetEngine, draft: DraftEngine, prompts: list[list[int]], k: int):
        self.target, self.draft, self.k = target, draft, k
        self.sids = [f"s{i}" for i in range(len(prompts))]
        self.token, self.drafts = {}, {}
        for sid, prompt in zip(self.sids, prompts, strict=True):
            first = target.prefill(sid, prompt, SamplingParams(), max_new_tokens=512)
            self.token[sid] = first.token
            self.drafts[sid] = list(draft.propose(sid, first.features, [*prompt[1:], first.token], k, create=True))

    def verify(self) -> list:
        steps = [Step("verify", self.target.sessions.get(sid), [self.token[sid], *self.drafts[sid]], True)
                 for sid in self.sids]
        return self.target._run_batch(steps)

    def propose(self, verdicts: list) -> None:
        steps = []
        for sid, verdict in zip(self.sids, verdicts, strict=True):
            news = [*verdict.accepted, verdict.bonus]
            steps.append(DraftStep(self.draft.sessions.get(sid), verdict.features, news, self.k))
            self.token[sid] = verdict.bonus
        for sid, drafts in zip(self.sids, self.draft._run_batch(steps), strict=True):
            self.drafts[sid] = list(drafts)

    def close(self) -> None:
        for sid in self.sids:
            self.target.release(sid)
            self.draft.release(sid)


def kv_copied(target: TargetEngine, pasts: list[int], width: int, kept: list[int]) -> tuple[int, int]:
    """(bytes copied, bytes of new tokens written) by one forward, from its shapes (see the docstring)."""
    per_token = target.kv_bytes_per_token
    if target.engine == "native":
        return 0, width * len(pasts) * per_token
    gathered = len(pasts) * max(pasts) * per_token
    return 2 * gathered + len(pasts) * width * per_token + 2 * sum(kept) * per_token, 0


def profile(name: str, target: TargetEngine, draft: DraftEngine, prompts: list[list[int]], k: int,
            rounds: int) -> dict:
    pair = Pair(target, draft, prompts, k)
    before = graph_kernels()
    for _ in range(3):  # warm-up: the verify's bucket compiles here (the prefills' before)
        pair.propose(pair.verify())
    in_graph = graph_kernels() - before  # the kernels of the verify's graph, launched once a forward
    graphs, kernels = counters["stats"]["unique_graphs"], graph_kernels()
    target_ms, draft_ms = [], []
    for _ in range(rounds):
        start = time.perf_counter()
        verdicts = pair.verify()
        middle = time.perf_counter()
        pair.propose(verdicts)
        target_ms.append(1e3 * (middle - start))
        draft_ms.append(1e3 * (time.perf_counter() - middle))
    pasts = [target.sessions.get(sid).length for sid in pair.sids]
    forward = getattr(target.runner, "_forward", None)
    if forward is not None and target.runner.compiled:  # the compiled graph runs outside the counter
        def outside(*args):
            with _disable_current_modes():
                return forward(*args)

        target.runner._forward = outside
    try:
        with OpCounter() as target_ops:
            verdicts = pair.verify()
    finally:
        if forward is not None:
            target.runner._forward = forward
    with OpCounter() as draft_ops:
        pair.propose(verdicts)
    b = len(prompts)
    copied, written = kv_copied(target, pasts, k + 1, [1 + len(v.accepted) for v in verdicts])
    row = {
        "engine": name, "batch": b,
        "ops_per_layer": round((target_ops.ops + in_graph) / target.num_layers, 1),
        "syncs_per_verify": round(target_ops.syncs / b, 3), "syncs_per_batch": target_ops.syncs,
        "syncs_per_rollout": round(draft_ops.syncs / b, 3),
        "kv_bytes_copied_per_forward": copied, "kv_bytes_written_per_forward": written,
        "recompiles_after_warmup": counters["stats"]["unique_graphs"] - graphs,
        "target_ms": round(statistics.median(target_ms), 2), "draft_ms": round(statistics.median(draft_ms), 2),
        "target_ops": target_ops.ops, "graph_kernels_per_forward": in_graph, "sync_ops": dict(target_ops.sync_ops),
        "graph_kernels_compiled_after_warmup": graph_kernels() - kernels,
    }
    pair.close()
    return row


def speed(target_dir: Path, draft_dir: Path, engine: str, compile: bool, prompts: list[list[int]], reps: int = 3) -> float:
    """Tokens/s of in-process generations one at a time, after an untimed pass over the same prompts (the
    compiled engine meets its buckets there: a round near the end drafts fewer tokens, a smaller bucket);
    the median of `reps` timed passes."""
    generator = InProcessGenerator(target_dir, draft_dir, draft_cost=0)
    generator.target = TargetEngine(target_dir, engine=engine, compile=compile,
                                    aux_layer_ids=list(generator.target.aux_layer_ids))
    request = GenerationRequest(prompt_ids=prompts[0], max_new_tokens=64, num_draft_tokens=4, ignore_eos=True)
    for prompt in prompts:
        generator.generate(request.model_copy(update={"prompt_ids": prompt}))
    rates = []
    for _ in range(reps):
        tokens, start = 0, time.perf_counter()
        for prompt in prompts:
            tokens += len(generator.generate(request.model_copy(update={"prompt_ids": prompt})).token_ids)
        rates.append(tokens / (time.perf_counter() - start))
    return statistics.median(rates)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument("--speed", action="store_true")
    parser.add_argument("--speed-prompts", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)
    # codegen each graph here (a cache hit generates no kernels to count)
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    demo = ensure_demo()
    target_dir, draft_dir = demo / "target", demo / "draft"
    prompts = [p["prompt_ids"] for p in load_prompts(demo)]
    draft = DraftEngine(draft_dir, target_dir)
    rows, speeds = [], {}
    for name in args.engines.split(","):
        engine, compile = ENGINES[name]
        target = TargetEngine(target_dir, engine=engine, compile=compile, aux_layer_ids=draft.config.aux_layer_ids,
                              max_batch_tokens=1 << 14)
        for b in (int(x) for x in args.batches.split(",")):
            rows.append(profile(name, target, draft, prompts[:b], args.k, args.rounds))
            print(json.dumps(rows[-1]), file=sys.stderr)
        if args.speed:
            speeds[name] = round(speed(target_dir, draft_dir, engine, compile, prompts[: args.speed_prompts]), 1)
    columns = ["engine", "batch", "ops_per_layer", "syncs_per_verify", "syncs_per_rollout",
               "kv_bytes_copied_per_forward", "recompiles_after_warmup", "target_ms", "draft_ms"]
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for row in rows:
        print("| " + " | ".join(str(row[c]) for c in columns) + " |")
    if speeds:
        print("\n| engine | in-process tokens/s, batch 1, K=4, 64 tokens |\n|---|---:|")
        for name, value in speeds.items():
            print(f"| {name} | {value} |")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "tokens_per_s": speeds, "k": args.k}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
