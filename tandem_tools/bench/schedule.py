"""The bench's schedule: which cases run, in which order, in which blocks, and the run that times them.

At concurrency c, c clients keep c requests in flight (vLLM's benchmark_serving --max-concurrency). The
cases take turns block by block, each block in a rotated order, so that a change in the machine's load
touches all of them alike.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from tandem.stats import mean_acceptance_length, percentile
from tandem_tools.bench.runners import (
    EAGLE3,
    EAGLE3_TREE,
    P_EAGLE,
    PEER,
    STACKS,
    TARGET_ONLY,
    AssistedRunner,
    InProcessRunner,
    Outcome,
    ServicesRunner,
    patiently,
)
from tandem_tools.bench.vllm_peer import VLLM, start_vllm_peer
from tandem_tools.bench.vllm_server import VLLM_SERVER, start_vllm_server_peer

# a case runs its requests in blocks of this many per client: the last requests of a block run with
# fewer than `concurrency` in flight, so blocks are long enough for that tail to be small; and at
# least two blocks, so that the cases take turns going first
BLOCK_PER_CLIENT = 4
MIN_BLOCKS = 2
WARM_REQUESTS = 4  # the untimed block of each case at each concurrency has at least this many requests (_warm_up)


@dataclass
class BenchConfig:
    target: Path
    draft: Path
    prompts: list[list[int]]
    assistant: Path | None = None
    categories: list[str | None] | None = None  # each prompt's (MT-Bench's), for acceptance by category
    stacks: Sequence[str] = STACKS
    num_draft_tokens: Sequence[int] = (1, 3, 5)
    temperatures: Sequence[float] = (0.0, 1.0)
    concurrency: Sequence[int] = (1,)
    overlap: Sequence[bool] | None = None  # None: each stack as its generator runs by default (`overlaps`)
    max_new_tokens: int = 64
    seed: int = 0
    threads: int = 1
    startup_timeout: float = 600.0
    vllm_python: Path | None = None  # --peer vllm or vllm-server: the vLLM venv's python
    vllm_peers: Sequence[str] = (VLLM,)  # with vllm_python: its offline engine (vllm_peer.py), its server (vllm_server.py)
    vllm_eager: bool = False  # vLLM without torch.compile: a quick start for tests, not for measuring
    trees: Sequence[int] = ()  # EAGLE-2 draft trees of these many nodes (cases "eagle3-tree"), beside the chains
    tree_depth: int | None = None  # none: the largest K, the chain's depth
    tree_top_k: int = 10  # children per expansion (the EAGLE-3 reference's)
    peagle: Path | None = None  # a second head, a P-EAGLE one: cases "p-eagle" through services of their own


@dataclass
class Case:
    stack: str
    mode: str
    K: int
    temperature: float
    concurrency: int
    overlap: bool = False
    tree: object = None  # an eagle3-tree case's TreeParams
    seconds: float = 0.0
    outcomes: list[Outcome] = field(default_factory=list)

    cpu_seconds: dict = field(default_factory=dict)  # the services' CPU seconds in the timed blocks, by process
    overlap_rounds: int = 0  # verify rounds the draft prepared the next one during, and hits among them
    overlap_hits: int = 0
    head: str | None = None  # the kind of head the case drafted with (services)
    draft_seconds: float = 0.0  # the draft engine's compute in the timed blocks (services)

    @property
    def label(self) -> str:
        if self.tree is not None:
            return f"{self.mode} N={self.tree.nodes}"
        return self.mode if self.mode == TARGET_ONLY else f"{self.mode} K={self.K}"

    def result(self, categories: Sequence[str | None] | None = None) -> dict:
        """The case's entry of the bench's JSON "runs"; with the prompts' categories, the mean acceptance
        length of each."""
        tokens = sum(o.tokens for o in self.outcomes)
        rounds = sum(o.rounds for o in self.outcomes)
        accepted = sum(o.accepted for o in self.outcomes)
        drafted = sum(o.drafted for o in self.outcomes)
        depth = max([self.K, *(len(o.per_position) for o in self.outcomes)])
        per_position = [sum(o.per_position[k] for o in self.outcomes if k < len(o.per_position))
                        for k in range(depth)]
        latencies = [o.seconds for o in self.outcomes]
        return {
            "stack": self.stack,
            "mode": self.mode,
            "K": self.K,
            "temperature": self.temperature,
            "concurrency": self.concurrency,
            "overlap": self.overlap,
            **({"tree": self.tree.nodes, "tree_depth": self.tree.depth, "tree_top_k": self.tree.top_k,
                "tree_rounds": sum(o.tree_rounds for o in self.outcomes)} if self.tree is not None else {}),
            **({"head": self.head, "draft_ms_per_round": round(1e3 * self.draft_seconds / rounds, 4) if rounds else 0.0}
               if self.head is not None else {}),
            "shed_rounds": round(sum(o.shed_rounds for o in self.outcomes) / rounds, 4) if rounds else 0.0,
            "overlap_hit_rate": round(self.overlap_hits / self.overlap_rounds, 4) if self.overlap_rounds else None,
            "tokens_per_s": tokens / self.seconds if self.seconds else 0.0,
            "mean_acceptance_length": mean_acceptance_length(accepted, rounds),
            "acceptance_per_draft": round(accepted / drafted, 4) if drafted else None,  # accepted / verified drafts
            "accepted_per_position": [round(c / rounds, 4) for c in per_position] if rounds else [],
            "latency_p50_s": round(percentile(latencies, 50), 4),
            "latency_p99_s": round(percentile(latencies, 99), 4),
            "num_prompts": len(self.outcomes),
            "generated_tokens": tokens,
            "seconds": round(self.seconds, 3),
            **({"cpu_busy": {name: round(used / self.seconds, 3) for name, used in sorted(self.cpu_seconds.items())}}
               if self.cpu_seconds and self.seconds else {}),
            **({"mean_acceptance_length_by_category": self.by_category(categories)}
               if categories and any(categories) and self.mode != TARGET_ONLY else {}),
        }

    def by_category(self, categories: Sequence[str | None]) -> dict[str, float]:
        """Mean acceptance length over the requests of each prompt category, in the order they first appear."""
        groups: dict[str, list[Outcome]] = {}
        for category in categories:
            if category is not None:
                groups.setdefault(category, [])
        for o in self.outcomes:
            if 0 <= o.prompt < len(categories) and categories[o.prompt] is not None:
                groups[categories[o.prompt]].append(o)
        return {name: mean_acceptance_length(sum(o.accepted for o in group), sum(o.rounds for o in group))
                for name, group in groups.items() if group}


def make_cases(config: BenchConfig, peer: bool, vllm: bool | Sequence[int] = False,
               vllm_server: Sequence[int] | None = None) -> list[Case]:
    """`vllm`: vLLM's cases too, EAGLE-3 at every K (True) or at these Ks (its engines that started);
    `vllm_server`: the Ks of vLLM's EAGLE-3 servers that started (None: no vLLM server)."""
    vllm_ks = config.num_draft_tokens if vllm is True else [] if vllm is False else list(vllm)
    cases = []
    for temperature in config.temperatures:
        for concurrency in config.concurrency:
            for stack in config.stacks:
                cases.append(Case(stack, TARGET_ONLY, 0, temperature, concurrency))
                cases += [Case(stack, EAGLE3, k, temperature, concurrency, overlap)
                          for k in config.num_draft_tokens for overlap in overlaps(config, stack)]
                if stack == "services" and config.peagle is not None:
                    cases += [Case(stack, P_EAGLE, k, temperature, concurrency, overlap)
                              for k in config.num_draft_tokens for overlap in overlaps(config, stack)]
                cases += [Case(stack, EAGLE3_TREE, max(config.num_draft_tokens), temperature, concurrency,
                               tree=tree_params(config, n)) for n in config.trees]
            if vllm is not False:  # vLLM's engines draft without overlap
                cases.append(Case(VLLM, TARGET_ONLY, 0, temperature, concurrency))
                cases += [Case(VLLM, EAGLE3, k, temperature, concurrency) for k in config.num_draft_tokens if k in vllm_ks]
            if vllm_server is not None:
                cases.append(Case(VLLM_SERVER, TARGET_ONLY, 0, temperature, concurrency))
                cases += [Case(VLLM_SERVER, EAGLE3, k, temperature, concurrency) for k in config.num_draft_tokens
                          if k in vllm_server]
            if peer and concurrency == 1:  # generate() with an assistant takes one sequence at a time
                cases += [Case("in-process", PEER, k, temperature, 1) for k in config.num_draft_tokens]
    return cases


def overlaps(config: BenchConfig, stack: str) -> Sequence[bool]:
    """Overlap on, off or both for a stack's EAGLE-3 cases: as asked, else as each runs by default, on through
    the services (`tandem serve`) and off in-process (`tandem generate --in-process`): on one device the ahead
    step is work done in series with the verify, not beside it."""
    return config.overlap if config.overlap is not None else (stack == "services",)


def tree_params(config: BenchConfig, nodes: int):
    from tandem.params import TreeParams

    return TreeParams(nodes=nodes, depth=config.tree_depth or max(config.num_draft_tokens), top_k=config.tree_top_k)


def concurrency_requests(prompts: list[list[int]], concurrency: int) -> list[list[int]]:
    """The prompts, repeated in turn until there are MIN_BLOCKS blocks of BLOCK_PER_CLIENT per client."""
    n = max(len(prompts), MIN_BLOCKS * BLOCK_PER_CLIENT * concurrency)
    return [prompts[i % len(prompts)] for i in range(n)]


def run_bench(config: BenchConfig, out_dir: Path, echo: Callable[[str], None] = print) -> list[dict]:
    """Every case of `config`, block by block; one Case.result() per case."""
    import torch

    torch.set_num_threads(config.threads)
    out_dir.mkdir(parents=True, exist_ok=True)
    runners: dict[tuple[str, str, bool], object] = {}  # (stack, mode, overlap)
    try:
        _start_runners(config, out_dir, runners, echo)
        vllm, server = runners.get((VLLM, TARGET_ONLY, False)), runners.get((VLLM_SERVER, TARGET_ONLY, False))
        cases = make_cases(config, peer=config.assistant is not None, vllm=False if vllm is None else vllm.ks,
                           vllm_server=None if server is None else server.ks)
        echo(f"bench: {len(cases)} cases x {len(config.prompts)} prompts x {config.max_new_tokens} tokens")
        warm = config.prompts[0]
        for case in cases:  # one short generation each: first-call allocations are not measured
            runner = runners[case.stack, case.mode, case.overlap]
            patiently(partial(runner.run, warm, case.mode, case.K, case.temperature, config.seed, 8, **_tree(case)),
                       echo)
        for c in sorted(set(config.concurrency)):
            group = [case for case in cases if case.concurrency == c]
            requests = concurrency_requests(config.prompts, c)
            size = BLOCK_PER_CLIENT * c
            _warm_up(group, runners, requests[: max(c, WARM_REQUESTS)], c, config, echo)
            for first in range(0, len(requests), size):
                offset = (first // size) % len(group)
                for case in group[offset:] + group[:offset]:  # rotated: no case always runs first
                    _run_block(case, runners[case.stack, case.mode, case.overlap], requests[first : first + size],
                               first, c, config)
                echo(f"bench: concurrency {c}: {min(first + size, len(requests))}/{len(requests)} requests")
    finally:
        for runner in {id(r): r for r in runners.values()}.values():
            runner.close()
    return [case.result(config.categories) for case in cases]


def _warm_up(group: list, runners: dict, requests: list, c: int, config: BenchConfig,
             echo: Callable[[str], None]) -> None:
    """One untimed block of each case, as vLLM's own warm-up (a compiled target meets this concurrency's
    buckets); once more after the target compiled what it met. Of WARM_REQUESTS at least: the acceptance
    gate starts from what the head accepted here, and one prompt's acceptance is not the traffic's (the
    demo's first prompt alone accepts far less than the bench's prompts, and from it the gate shed most of
    the compiled target's EAGLE-3 rounds at one request)."""
    for again in (False, True):
        for case in group:
            runner = runners[case.stack, case.mode, case.overlap]
            if not hasattr(runner, "run_block"):  # vLLM's worker warms up at every concurrency itself
                _run_block(case, runner, requests, 0, c, config, timed=False)
        unique = {id(r): r for r in runners.values()}.values()
        waited = [r.settle(echo) for r in unique if hasattr(r, "settle")]  # every runner settles
        if again or not any(waited):
            return


def _start_runners(config: BenchConfig, out_dir: Path, runners: dict, echo: Callable[[str], None]) -> None:
    """Into `runners`, as each starts (so that a failure stops those already started): one per
    (stack, mode, overlap) the cases use; target-only shares the services without overlap."""
    if "services" in config.stacks:
        for overlap in sorted(set(overlaps(config, "services"))):
            echo(f"bench: starting the target, draft and coordinator services (tandem serve --overlap "
                 f"{'on' if overlap else 'off'}) ...")
            log = out_dir / ("serve-overlap.log" if overlap else "serve.log")
            services = ServicesRunner(config.target, config.draft, log, config.startup_timeout, overlap)
            runners["services", EAGLE3, overlap] = services
            if not overlap:  # trees run without overlap
                runners["services", EAGLE3_TREE, False] = services
            runners.setdefault(("services", TARGET_ONLY, False), services)
            if config.peagle is not None:
                echo(f"bench: starting services for the P-EAGLE head {config.peagle} ...")
                runners["services", P_EAGLE, overlap] = ServicesRunner(
                    config.target, config.peagle, out_dir / f"serve-peagle{'-overlap' if overlap else ''}.log",
                    config.startup_timeout, overlap)
    if "in-process" in config.stacks:
        inprocess = InProcessRunner(config.target, config.draft)
        runners["in-process", TARGET_ONLY, False] = runners["in-process", EAGLE3, False] = inprocess
        runners["in-process", EAGLE3_TREE, False] = inprocess
        runners["in-process", EAGLE3, True] = InProcessRunner(config.target, config.draft, True, inprocess.generator)
    if config.assistant is not None:
        runners["in-process", PEER, False] = AssistedRunner(config.target, config.assistant)
    if config.vllm_python is not None and VLLM_SERVER in config.vllm_peers:  # None back: skipped, with a line
        server = start_vllm_server_peer(config.vllm_python, config.target, config.draft, config.num_draft_tokens,
                                        config.prompts, config.max_new_tokens, out_dir, echo, config.vllm_eager)
        if server is not None:
            runners[VLLM_SERVER, TARGET_ONLY, False] = runners[VLLM_SERVER, EAGLE3, False] = server
    if config.vllm_python is not None and VLLM in config.vllm_peers:  # None back when vLLM cannot run here
        vllm = start_vllm_peer(config.vllm_python, config.target, config.draft, config.num_draft_tokens,
                               config.prompts, config.max_new_tokens, config.concurrency, out_dir, echo,
                               config.vllm_eager)
        if vllm is not None:
            runners[VLLM, TARGET_ONLY, False] = runners[VLLM, EAGLE3, False] = vllm


def _tree(case: Case) -> dict:
    return {"tree": case.tree} if case.tree is not None else {}


def _run_block(case: Case, runner, batch: list[list[int]], first: int, concurrency: int, config: BenchConfig,
               timed: bool = True) -> None:
    """`concurrency` clients take the block's requests one after another: a client that finishes
    starts the next request at once, so `concurrency` are in flight until the block runs out
    (vLLM's benchmark_serving --max-concurrency)."""
    def one(i: int) -> Outcome:
        started = time.perf_counter()
        outcome = runner.run(batch[i], case.mode, case.K, case.temperature, config.seed + first + i,
                             config.max_new_tokens, **_tree(case))
        outcome.seconds = time.perf_counter() - started
        return outcome

    if hasattr(runner, "run_block"):  # vLLM: its worker keeps `concurrency` in flight and times the block
        seconds, outcomes = runner.run_block(case.mode, case.K, case.temperature, batch,
                                             [config.seed + first + i for i in range(len(batch))],
                                             config.max_new_tokens, concurrency)
    else:
        cpu = runner.cpu_seconds() if hasattr(runner, "cpu_seconds") else {}
        drafting = case.mode != TARGET_ONLY and hasattr(runner, "draft_compute_seconds")
        draft_before = runner.draft_compute_seconds() if drafting else 0.0
        started = time.perf_counter()
        if concurrency == 1:
            outcomes = [one(i) for i in range(len(batch))]
        else:
            with ThreadPoolExecutor(concurrency) as pool:
                outcomes = list(pool.map(one, range(len(batch))))
        seconds = time.perf_counter() - started
        if drafting and timed:
            case.head = runner.head
            case.draft_seconds += runner.draft_compute_seconds() - draft_before
        if cpu and timed:
            for name, used in runner.cpu_seconds().items():
                case.cpu_seconds[name] = case.cpu_seconds.get(name, 0.0) + used - cpu.get(name, used)
        time.sleep(getattr(runner, "spin_s", 0.0))  # untimed: vLLM's server spins a while after its last request
    if not timed:
        return
    for i, outcome in enumerate(outcomes):
        outcome.prompt = (first + i) % len(config.prompts)  # concurrency_requests: the prompts in turn
    case.seconds += seconds
    case.outcomes += outcomes
    case.overlap_rounds += sum(o.overlap_rounds for o in outcomes)
    case.overlap_hits += sum(o.overlap_hits for o in outcomes)
