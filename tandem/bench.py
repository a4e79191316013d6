"""`tandem bench`: tokens/s of target-only decoding, EAGLE-3 at each K, and the peer a user has today
(transformers' assisted generation with a small draft LM), measured side by side in one run on held-out
prompts.

    tandem bench --demo                                   the demo pair (`tandem demo build`)
    tandem bench --target T --draft D [--assistant A]     any pair; --assistant adds the peer

Stacks: `services` starts the three processes (`tandem serve`; with `--overlap on,off` one stack per
setting, the coordinator's --overlap) and calls the coordinator with coordinator.client; `in-process` runs both engines in this process (tandem.inprocess). The peer
(mode `assisted-peer`) is `target.generate(..., assistant_model=assistant)` with num_assistant_tokens=K
(constant schedule, transformers' default confidence threshold), in this process.

Every case decodes every prompt to exactly --max-new-tokens tokens (EOS does not stop it), after one
warm-up generation. At concurrency c, c clients keep c requests in flight (a client starts its next
request as soon as one ends, vLLM's benchmark_serving --max-concurrency); the prompts repeat until
there are 8 requests per client. The cases take turns block by block (4c requests at a time), each
block in a rotated order, so that a change in the machine's load touches all of them alike.

Output: a markdown table on stdout; with --json PATH, {"runs": [...]} (one entry per case, the fields of
RunResult) and a PNG next to it; without, the PNG goes under --out. `accepted_per_position[k]` is the
fraction of verify rounds in which draft k+1 was accepted; `mean_acceptance_length` is tokens committed per
verify round (1 for target-only).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

STACKS = ("services", "in-process")
TARGET_ONLY, EAGLE3, PEER = "target-only", "eagle3", "assisted-peer"


@dataclass
class Outcome:
    """One generation: tokens out, and its verify rounds."""

    tokens: int
    rounds: int
    accepted: int
    per_position: list[int]  # [K] rounds in which draft k was accepted
    seconds: float = 0.0  # the request's latency, as its client saw it
    overlap_rounds: int = 0
    overlap_hits: int = 0


@dataclass
class Case:
    stack: str
    mode: str
    K: int
    temperature: float
    concurrency: int
    overlap: bool = False
    seconds: float = 0.0
    outcomes: list[Outcome] = field(default_factory=list)

    overlap_rounds: int = 0  # verify rounds the draft prepared the next one during, and hits among them
    overlap_hits: int = 0

    @property
    def label(self) -> str:
        return self.mode if self.mode == TARGET_ONLY else f"{self.mode} K={self.K}"

    def result(self) -> dict:
        tokens = sum(o.tokens for o in self.outcomes)
        rounds = sum(o.rounds for o in self.outcomes)
        accepted = sum(o.accepted for o in self.outcomes)
        per_position = [sum(o.per_position[k] for o in self.outcomes if k < len(o.per_position))
                        for k in range(self.K)]
        latencies = sorted(o.seconds for o in self.outcomes)
        return {
            "stack": self.stack,
            "mode": self.mode,
            "K": self.K,
            "temperature": self.temperature,
            "concurrency": self.concurrency,
            "overlap": self.overlap,
            "overlap_hit_rate": round(self.overlap_hits / self.overlap_rounds, 4) if self.overlap_rounds else None,
            "tokens_per_s": tokens / self.seconds if self.seconds else 0.0,
            "mean_acceptance_length": 1.0 + accepted / rounds if rounds else 0.0,
            "accepted_per_position": [round(c / rounds, 4) for c in per_position] if rounds else [],
            "latency_p50_s": round(percentile(latencies, 50), 4),
            "latency_p99_s": round(percentile(latencies, 99), 4),
            "num_prompts": len(self.outcomes),
            "generated_tokens": tokens,
            "seconds": round(self.seconds, 3),
        }


def percentile(ordered: list[float], q: float) -> float:
    """The q-th percentile of sorted values, by linear interpolation (numpy's default)."""
    if not ordered:
        return 0.0
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass
class BenchConfig:
    target: Path
    draft: Path
    prompts: list[list[int]]
    assistant: Path | None = None
    stacks: Sequence[str] = STACKS
    num_draft_tokens: Sequence[int] = (1, 3, 5)
    temperatures: Sequence[float] = (0.0, 1.0)
    concurrency: Sequence[int] = (1,)
    overlap: Sequence[bool] = (False,)
    split_cpus: bool = True  # services: tandem serve --split-cpus
    max_new_tokens: int = 64
    seed: int = 0
    threads: int = 1
    startup_timeout: float = 600.0


# -- the runners: one generation each, on one stack --------------------------------------------------------


class ServicesRunner:
    """The three-process stack, started with `tandem serve`, called through coordinator.client."""

    stack = "services"

    def __init__(self, target: Path, draft: Path, log: Path, startup_timeout: float, overlap: bool = False,
                 split_cpus: bool = True):
        from coordinator.client import TandemClient

        self.log = log
        from tandem.serve import launch

        self.proc, self.address = launch(["--target", str(target), "--draft", str(draft), "--port", "0",
                                          "--startup-timeout", str(startup_timeout),
                                          "--overlap", "on" if overlap else "off",
                                          "--split-cpus", "on" if split_cpus else "off"], log)
        self.client = TandemClient(self.address, timeout=startup_timeout)

    def run(self, prompt_ids: list[int], mode: str, k: int, temperature: float, seed: int, max_new: int) -> Outcome:
        result = self.client.generate(
            prompt_ids=prompt_ids, max_new_tokens=max_new, num_draft_tokens=k, temperature=temperature,
            seed=seed, ignore_eos=True, speculate=mode == EAGLE3,
        )
        return _outcome(result.token_ids, result.stats)

    def close(self) -> None:
        self.client.close()
        from tandem.serve import stop

        stop(self.proc)


class InProcessRunner:
    """Both engines in this process, driven by the coordinator's round loop (tandem.inprocess)."""

    stack = "in-process"

    def __init__(self, target: Path, draft: Path, overlap: bool = False, generator=None):
        from tandem.inprocess import InProcessGenerator

        self.generator = generator or InProcessGenerator(target, draft)
        self.overlap = overlap

    def run(self, prompt_ids: list[int], mode: str, k: int, temperature: float, seed: int, max_new: int) -> Outcome:
        from tandem.params import GenerationRequest, SamplingParams

        request = GenerationRequest(
            prompt_ids=prompt_ids, max_new_tokens=max_new, num_draft_tokens=k, ignore_eos=True,
            sampling=SamplingParams(temperature=temperature, seed=seed), speculate=mode == EAGLE3,
        )
        result = self.generator.generate(request, overlap=self.overlap)
        return _outcome(result.token_ids, result.stats)

    def close(self) -> None:
        pass


def _outcome(token_ids: list[int], s: dict) -> Outcome:
    return Outcome(len(token_ids), s["num_rounds"], s["num_accepted_tokens"], s["accepted_per_position"],
                   overlap_rounds=s.get("num_overlap_rounds", 0), overlap_hits=s.get("num_overlap_hits", 0))


class AssistedRunner:
    """transformers' assisted generation: the target's generate() with a small draft LM as assistant_model.

    Its verify rounds are the target's forwards; a forward hook reads, from the KV length each one starts
    at, how many drafts the previous round accepted."""

    stack = "in-process"

    def __init__(self, target: Path, assistant: Path):
        import torch
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()  # generate() warns about its own assistant's arguments
        self.torch = torch
        self.target = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
        self.assistant = AutoModelForCausalLM.from_pretrained(assistant, dtype=torch.float32).eval()
        self._forwards: list[tuple[int, int]] = []  # (input length, KV length) per target forward
        self.target.register_forward_pre_hook(self._hook, with_kwargs=True)
        self._lock = threading.Lock()  # generate() is not reentrant over one assistant

    def _hook(self, module, args, kwargs) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        cache = kwargs.get("past_key_values")
        self._forwards.append((int(ids.shape[1]), int(cache.get_seq_length()) if cache is not None else 0))

    def run(self, prompt_ids: list[int], mode: str, k: int, temperature: float, seed: int, max_new: int) -> Outcome:
        torch = self.torch
        config = copy.deepcopy(self.target.generation_config)
        config.eos_token_id = None  # exactly max_new tokens, as ignore_eos does on our stacks
        config.pad_token_id = self.target.config.eos_token_id
        config.max_new_tokens = max_new
        config.do_sample = temperature > 0
        if config.do_sample:  # the same distribution as our sampler: no top-k, no top-p
            config.temperature, config.top_k, config.top_p = temperature, 0, 1.0
        self.assistant.generation_config.num_assistant_tokens = k
        self.assistant.generation_config.num_assistant_tokens_schedule = "constant"
        ids = torch.tensor([prompt_ids])
        with self._lock, torch.inference_mode():
            torch.manual_seed(seed)
            self._forwards.clear()
            out = self.target.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config,
                                       assistant_model=self.assistant)
            forwards = list(self._forwards)
        new = int(out.shape[1]) - len(prompt_ids)
        return Outcome(new, len(forwards), new - len(forwards), _accepted_per_position(forwards, len(prompt_ids),
                                                                                       new, k))

    def close(self) -> None:
        pass


def _accepted_per_position(forwards: list[tuple[int, int]], prompt_len: int, new: int, k: int) -> list[int]:
    """Rounds in which draft j was accepted, from the KV length each target forward started at: after a
    round the KV holds every committed token but its bonus, so round r accepted kv[r+1] - kv[r] - 1 drafts
    (the first round, which also reads the prompt: kv[1] - prompt_len)."""
    ends = [kv for _, kv in forwards[1:]] + [prompt_len + new - 1]
    starts = [prompt_len - 1] + [kv for _, kv in forwards[1:]]
    counts = [0] * k
    for start, end in zip(starts, ends):
        for j in range(min(k, max(0, end - start - 1))):
            counts[j] += 1
    return counts


# -- the run -----------------------------------------------------------------------------------------------


def make_cases(config: BenchConfig, peer: bool) -> list[Case]:
    cases = []
    for temperature in config.temperatures:
        for concurrency in config.concurrency:
            for stack in config.stacks:
                cases.append(Case(stack, TARGET_ONLY, 0, temperature, concurrency))
                cases += [Case(stack, EAGLE3, k, temperature, concurrency, overlap)
                          for k in config.num_draft_tokens for overlap in config.overlap]
            if peer and concurrency == 1:  # generate() with an assistant takes one sequence at a time
                cases += [Case("in-process", PEER, k, temperature, 1) for k in config.num_draft_tokens]
    return cases


def run_bench(config: BenchConfig, out_dir: Path, echo: Callable[[str], None] = print) -> list[dict]:
    import torch

    torch.set_num_threads(config.threads)
    out_dir.mkdir(parents=True, exist_ok=True)
    runners: dict[tuple[str, str, bool], object] = {}  # (stack, mode, overlap)
    try:
        if "services" in config.stacks:
            for overlap in sorted(set(config.overlap)):
                echo(f"bench: starting the target, draft and coordinator services (tandem serve --overlap "
                     f"{'on' if overlap else 'off'}) ...")
                log = out_dir / ("serve-overlap.log" if overlap else "serve.log")
                services = ServicesRunner(config.target, config.draft, log, config.startup_timeout, overlap,
                                          config.split_cpus)
                runners["services", EAGLE3, overlap] = services
                runners.setdefault(("services", TARGET_ONLY, False), services)
        if "in-process" in config.stacks:
            inprocess = InProcessRunner(config.target, config.draft)
            runners["in-process", TARGET_ONLY, False] = runners["in-process", EAGLE3, False] = inprocess
            runners["in-process", EAGLE3, True] = InProcessRunner(config.target, config.draft, True,
                                                                  inprocess.generator)
        if config.assistant is not None:
            runners["in-process", PEER, False] = AssistedRunner(config.target, config.assistant)
        cases = make_cases(config, peer=config.assistant is not None)
        echo(f"bench: {len(cases)} cases x {len(config.prompts)} prompts x {config.max_new_tokens} tokens")
        warm = config.prompts[0]
        for case in cases:  # one short generation each: first-call allocations are not measured
            runners[case.stack, case.mode, case.overlap].run(warm, case.mode, case.K, case.temperature, config.seed, 8)
        for c in sorted(set(config.concurrency)):
            group = [case for case in cases if case.concurrency == c]
            requests = concurrency_requests(config.prompts, c)
            blocks = [requests[i : i + BLOCK_PER_CLIENT * c] for i in range(0, len(requests), BLOCK_PER_CLIENT * c)]
            first = 0
            for b, block in enumerate(blocks):
                offset = b % len(group)
                for case in group[offset:] + group[:offset]:  # rotated: no case always runs first
                    _run_block(case, runners[case.stack, case.mode, case.overlap], block, first, c, config)
                first += len(block)
                echo(f"bench: concurrency {c}: {first}/{len(requests)} requests")
    finally:
        for runner in {id(r): r for r in runners.values()}.values():
            runner.close()
    return [case.result() for case in cases]


# a case runs its requests in blocks of this many per client: the last requests of a block run with
# fewer than `concurrency` in flight, so blocks are long enough for that tail to be small; and at
# least two blocks, so that the cases take turns going first
BLOCK_PER_CLIENT = 4
MIN_BLOCKS = 2


def concurrency_requests(prompts: list[list[int]], concurrency: int) -> list[list[int]]:
    """The prompts, repeated in turn until there are MIN_BLOCKS blocks of BLOCK_PER_CLIENT per client."""
    n = max(len(prompts), MIN_BLOCKS * BLOCK_PER_CLIENT * concurrency)
    return [prompts[i % len(prompts)] for i in range(n)]


def _run_block(case: Case, runner, batch: list[list[int]], first: int, concurrency: int, config: BenchConfig) -> None:
    """`concurrency` clients take the block's requests one after another: a client that finishes
    starts the next request at once, so `concurrency` are in flight until the block runs out
    (vLLM's benchmark_serving --max-concurrency)."""
    def one(i: int) -> Outcome:
        started = time.perf_counter()
        outcome = runner.run(batch[i], case.mode, case.K, case.temperature, config.seed + first + i,
                             config.max_new_tokens)
        outcome.seconds = time.perf_counter() - started
        return outcome

    started = time.perf_counter()
    if concurrency == 1:
        outcomes = [one(i) for i in range(len(batch))]
    else:
        with ThreadPoolExecutor(concurrency) as pool:
            outcomes = list(pool.map(one, range(len(batch))))
    case.seconds += time.perf_counter() - started
    case.outcomes += outcomes
    case.overlap_rounds += sum(o.overlap_rounds for o in outcomes)
    case.overlap_hits += sum(o.overlap_hits for o in outcomes)


# -- the report --------------------------------------------------------------------------------------------


def speedups(runs: list[dict]) -> list[float | None]:
    """tokens/s over target-only on the same stack, temperature and concurrency (the peer: over in-process,
    else over the services when only they ran)."""
    base = {(r["stack"], r["temperature"], r["concurrency"]): r["tokens_per_s"] for r in runs
            if r["mode"] == TARGET_ONLY}
    out = []
    for r in runs:
        b = base.get((r["stack"], r["temperature"], r["concurrency"])) or base.get(
            ("services", r["temperature"], r["concurrency"]))
        out.append(r["tokens_per_s"] / b if b else None)
    return out


def markdown_table(runs: list[dict]) -> str:
    lines = [
        ("| stack | mode | K | temperature | concurrency | overlap (hit rate) | tokens/s | speedup "
         "| latency p50 / p99 (s) | mean acceptance length | accepted per position |"),
        "|---|---|---:|---:|---:|---|---:|---:|---:|---:|---|",
    ]
    for r, s in zip(runs, speedups(runs)):
        positions = " ".join(f"{p:.2f}" for p in r["accepted_per_position"]) or "-"
        lines.append(
            f"| {r['stack']} | {r['mode']} | {r['K']} | {r['temperature']:g} | {r['concurrency']} "
            f"| {_overlap_cell(r)} | {r['tokens_per_s']:.1f} | {'-' if s is None else f'{s:.2f}x'} "
            f"| {r['latency_p50_s']:.2f} / {r['latency_p99_s']:.2f} | {r['mean_acceptance_length']:.2f} "
            f"| {positions} |"
        )
    return "\n".join(lines)


def _overlap_cell(r: dict) -> str:
    if not r.get("overlap"):
        return "off"
    rate = r.get("overlap_hit_rate")
    return "on" if rate is None else f"on ({rate:.0%})"


def plot_runs(runs: list[dict], path: Path, title: str = "") -> Path:
    """One panel per (temperature, concurrency): tokens/s per case, bars grouped by stack, each bar
    labelled with its speedup over target-only and its mean acceptance length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["temperature"], r["concurrency"]) for r in runs})
    fig, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), 5.5), squeeze=False, layout="constrained")
    colors = {TARGET_ONLY: "#7f7f7f", EAGLE3: "#d62728", PEER: "#1f77b4"}
    ups = speedups(runs)
    for ax, (temperature, concurrency) in zip(axes[0], panels):
        items = [(r, s) for r, s in zip(runs, ups) if (r["temperature"], r["concurrency"]) == (temperature, concurrency)]
        top_k = max(1, max(r["K"] for r, _ in items))
        x, ticks, groups = 0.0, [], {}
        for r, s in items:
            group = "assisted generation" if r["mode"] == PEER else r["stack"]
            if groups and group not in groups:
                x += 0.7  # a gap between groups
            groups.setdefault(group, []).append(x)
            shade = 1.0 if r["mode"] == TARGET_ONLY else 0.45 + 0.55 * r["K"] / top_k
            ax.bar(x, r["tokens_per_s"], color=colors[r["mode"]], alpha=shade)
            note = "" if s is None else f"{s:.2f}x"
            if r["mode"] != TARGET_ONLY:
                note += f"\nτ={r['mean_acceptance_length']:.2f}"
            ax.text(x, r["tokens_per_s"], note, ha="center", va="bottom", fontsize=8)
            tick = "target\nonly" if r["mode"] == TARGET_ONLY else f"K={r['K']}"
            ticks.append((x, tick + ("\noverlap" if r.get("overlap") else "")))
            x += 1.0
        ax.set_xticks([p for p, _ in ticks], [t for _, t in ticks], fontsize=8)
        for group, xs in groups.items():
            ax.annotate(group, (sum(xs) / len(xs), 0), xycoords=("data", "axes fraction"), xytext=(0, -34),
                        textcoords="offset points", ha="center", va="top", fontsize=10, fontweight="bold")
        ax.set_ylabel("generated tokens/s")
        ax.set_title(f"temperature {temperature:g}, concurrency {concurrency}")
        ax.margins(y=0.18)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    fig.legend(handles, ["target-only", "EAGLE-3 (tandem)", "assisted generation (transformers)"],
               loc="outside lower center", ncol=3, fontsize=9)
    fig.suptitle(title or "tandem bench")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# -- command line ------------------------------------------------------------------------------------------


def _list(cast):
    def parse(text: str):
        try:
            return [cast(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}") from None

    return parse


def _on_off(text: str) -> bool:
    if text.strip() not in ("on", "off"):
        raise ValueError(text)
    return text.strip() == "on"


def _prompts(args: argparse.Namespace, target: Path, demo: Path | None) -> list[list[int]]:
    if args.prompts:
        from transformers import AutoTokenizer

        from tandem.profile import load_prompts as read_prompt_file

        tokenizer = AutoTokenizer.from_pretrained(target)
        items = read_prompt_file(Path(args.prompts))
        prompts = [p if isinstance(p, list) else tokenizer(p)["input_ids"] for p in items]
    elif demo is not None:
        from tandem.demo import load_prompts

        prompts = [p["prompt_ids"] for p in load_prompts(demo)]
    else:
        from transformers import AutoTokenizer

        from tandem.demo import heldout_prompts, split_files, stdlib_files

        tokenizer = AutoTokenizer.from_pretrained(target)
        _, heldout = split_files(stdlib_files(), 10)
        prompts = [p["prompt_ids"] for p in heldout_prompts(tokenizer, heldout, args.num_prompts, 48, args.seed)]
    if len(prompts) < args.num_prompts:
        print(f"bench: {len(prompts)} prompts available, fewer than --num-prompts {args.num_prompts}", file=sys.stderr)
    return prompts[: args.num_prompts]


def cmd_bench(args: argparse.Namespace) -> int:
    demo = None
    if args.demo:
        from tandem.demo import ensure_demo

        demo = ensure_demo()
        target, draft, assistant = demo / "target", demo / "draft", demo / "assistant"
    elif args.target and args.draft:
        target, draft, assistant = Path(args.target), Path(args.draft), args.assistant and Path(args.assistant)
    else:
        print("tandem bench: give --demo, or --target DIR --draft DIR [--assistant DIR]", file=sys.stderr)
        return 2
    if args.no_peer:
        assistant = None
    bad = [s for s in args.stack if s not in STACKS]
    if bad:
        raise ValueError(f"--stack takes {', '.join(STACKS)}; got {bad}")
    if args.num_prompts < 1 or args.max_new_tokens < 1 or min(args.concurrency) < 1:
        raise ValueError("--num-prompts, --max-new-tokens and --concurrency must be at least 1")
    config = BenchConfig(
        target=target, draft=draft, assistant=assistant, prompts=_prompts(args, target, demo), stacks=args.stack,
        num_draft_tokens=args.num_draft_tokens, temperatures=args.temperature, concurrency=args.concurrency,
        max_new_tokens=args.max_new_tokens, seed=args.seed, threads=args.threads, overlap=args.overlap,
        split_cpus=args.split_cpus,
    )
    out = Path(args.out)
    runs = run_bench(config, out, echo=lambda m: print(m, file=sys.stderr, flush=True))
    print(markdown_table(runs))
    plot = Path(args.json).with_suffix(".png") if args.json else out / "bench.png"
    plot.parent.mkdir(parents=True, exist_ok=True)
    plot_runs(runs, plot, title=f"tandem bench: {'the demo pair' if demo else target}, {len(config.prompts)} prompts x "
                                 f"{config.max_new_tokens} tokens; labels: speedup over target-only, "
                                 f"τ = mean acceptance length")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "runs": runs,
            "config": {**{k: str(v) if isinstance(v, Path) else v for k, v in asdict(config).items()
                          if k != "prompts"}, "num_prompts": len(config.prompts)},
        }, indent=2))
        print(f"bench: wrote {args.json} and {plot}", file=sys.stderr)
    else:
        print(f"bench: wrote {plot}", file=sys.stderr)
    return 0


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    """Register `tandem bench` on an argparse subparsers object."""
    p = subparsers.add_parser("bench", help="tokens/s: target-only vs EAGLE-3 at each K vs assisted generation")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--demo", action="store_true", help="the demo pair (built on first use: tandem demo build)")
    which.add_argument("--target", help="target checkpoint directory")
    p.add_argument("--draft", help="with --target: the EAGLE-3 head")
    p.add_argument("--assistant", help="with --target: a small LM for the assisted-generation peer")
    p.add_argument("--no-peer", action="store_true", help="leave out the assisted-generation peer")
    p.add_argument("--stack", type=_list(str), default=list(STACKS), help="services,in-process (default both)")
    p.add_argument("--num-draft-tokens", "-k", type=_list(int), default=[1, 3, 5], help="K values (default 1,3,5)")
    p.add_argument("--temperature", type=_list(float), default=[0.0, 1.0], help="default 0,1")
    p.add_argument("--concurrency", type=_list(int), default=[1], help="concurrent requests (default 1)")
    p.add_argument("--overlap", type=_list(_on_off), default=[False],
                   help="on,off: EAGLE-3 cases with overlapped drafting, without, or both (default off)")
    p.add_argument("--split-cpus", type=_on_off, default=True,
                   help="services: tandem serve --split-cpus, the target on half the CPUs and the draft and the "
                        "coordinator on the rest (default on)")
    p.add_argument("--num-prompts", "-n", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--prompts", metavar="FILE", help="one prompt per line, or .jsonl with prompt / prompt_ids")
    p.add_argument("--seed", type=int, default=0, help="sampling: prompt i gets seed + i")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads of this process (in-process and peer; the services split the cores)")
    p.add_argument("--json", metavar="PATH", help="write the runs as JSON here (and the plot next to it)")
    p.add_argument("--out", default="tandem-bench", metavar="DIR",
                   help="the plot (without --json) and serve.log go here (default ./tandem-bench)")
    p.set_defaults(func=cmd_bench)
    return p
