"""The bench's runners: each runs one generation on one stack and says what came out (an Outcome).

    ServicesRunner   the three processes (`tandem serve`), called through coordinator.client
    InProcessRunner  both engines in this process (tandem_tools.inprocess)
    AssistedRunner   the peer: transformers' generate() with a small draft LM as assistant_model
"""

from __future__ import annotations

import copy
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

STACKS = ("services", "in-process")
PATIENCE_S, PATIENCE_POLL_S = 300.0, 2.0  # how long a call waits out a service marked down, and how often
T = TypeVar("T")
TARGET_ONLY, EAGLE3, EAGLE3_TREE, PEER = "target-only", "eagle3", "eagle3-tree", "assisted-peer"
P_EAGLE = "p-eagle"  # EAGLE-3 with a second head, a P-EAGLE one (--draft-peagle): its own services


@dataclass
class Outcome:
    """One generation: tokens out, and its verify rounds."""

    tokens: int
    rounds: int
    accepted: int
    per_position: list[int]  # [K] rounds in which draft k was accepted
    drafted: int = 0  # draft tokens verified
    seconds: float = 0.0  # the request's latency, as its client saw it
    overlap_rounds: int = 0
    overlap_hits: int = 0
    tree_rounds: int = 0  # verify rounds of a draft tree
    shed_rounds: int = 0  # rounds run target-only because adaptive K or the acceptance gate shed the drafts
    prompt: int = -1  # the index of its prompt in the bench's prompts (for acceptance by category)


def patiently(call: Callable[[], T], echo: Callable[[str], None], patience: float = PATIENCE_S) -> T:
    """`call()`, again while the server answers UNAVAILABLE: on a busy machine (a compile, vLLM's start) the
    coordinator may have marked a service down that missed three health checks, and takes it back when it
    answers (a bench beside a compile would lose its warm-up to that)."""
    from coordinator.client import TandemError

    deadline = time.monotonic() + patience
    while True:
        try:
            return call()
        except TandemError as exc:
            if exc.code.name != "UNAVAILABLE" or time.monotonic() >= deadline:
                raise
            echo(f"bench: the server is not ready ({exc.details}); trying again ...")
            time.sleep(PATIENCE_POLL_S)


class ServicesRunner:
    """The three-process stack, started with `tandem serve`, called through coordinator.client."""

    stack = "services"

    def __init__(self, target: Path, draft: Path, log: Path, startup_timeout: float, overlap: bool = False):
        from coordinator.client import TandemClient
        from draft_server.checkpoint import head_kind
        from tandem_tools.serve import launch, metrics_addresses

        self.log = log
        self.head = head_kind(draft)
        printed: list[str] = []
        self.proc, self.address = launch(["--target", str(target), "--draft", str(draft), "--port", "0",
                                          "--overlap", "on" if overlap else "off", "--metrics-port", "0"], log,
                                         lines=printed)
        self.draft_metrics = metrics_addresses(printed)["draft"]  # the draft's step times: draft_compute_seconds
        self.client = TandemClient(self.address, timeout=startup_timeout)

    def draft_compute_seconds(self) -> float:
        """The draft engine's compute so far, its proposes' and aheads' (tandem:step_compute_seconds)."""
        import urllib.request

        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(f"http://{self.draft_metrics}/metrics", timeout=10) as response:
            text = response.read().decode()
        return sum(sample.value for family in text_string_to_metric_families(text)
                   if family.name == "tandem:step_compute_seconds" for sample in family.samples
                   if sample.name.endswith("_sum") and sample.labels.get("step") in ("propose", "ahead"))

    def run(self, prompt_ids: list[int], mode: str, k: int, temperature: float, seed: int, max_new: int,
            tree=None) -> Outcome:
        result = self.client.generate(
            prompt_ids=prompt_ids, max_new_tokens=max_new, num_draft_tokens=k, temperature=temperature,
            seed=seed, ignore_eos=True, speculate=mode != TARGET_ONLY, tree=tree,
        )
        return _outcome(result.token_ids, result.stats)

    def settle(self, echo: Callable[[str], None]) -> bool:
        """Wait while the target compiles the buckets it has met and the draft its calls (they run eagerly
        meanwhile: not what is measured); whether there were any."""
        waited = False
        while (info := patiently(self.client.server_info, echo)).target_buckets_compiling or info.draft_compiling:
            if not waited:
                echo(f"bench: the target is compiling {info.target_buckets_compiling} token bucket(s) of its "
                     f"forward{', the draft its calls' if info.draft_compiling else ''}; waiting ...")
            waited = True
            time.sleep(1.0)
        return waited

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds each service process has used so far (Linux /proc): with the wall time of a case, how
        busy each kept its cores (two devices are for keeping both busy)."""
        out: dict[str, float] = {}
        tick = os.sysconf("SC_CLK_TCK")
        for pid in _children(self.proc.pid):
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            name = next((a.decode() for a in argv if a in (b"target", b"draft", b"coordinator")), None)
            if name is not None:
                out[name] = (int(stat[11]) + int(stat[12])) / tick  # utime + stime
        return out

    def close(self) -> None:
        from tandem_tools.serve import stop

        self.client.close()
        stop(self.proc)


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


class InProcessRunner:
    """Both engines in this process, driven by the shared round loop (tandem_tools.inprocess)."""

    stack = "in-process"

    def __init__(self, target: Path, draft: Path, overlap: bool = False, generator=None):
        from tandem_tools.inprocess import InProcessGenerator

        self.generator = generator or InProcessGenerator(target, draft)
        self.overlap = overlap

    def run(self, prompt_ids: list[int], mode: str, k: int, temperature: float, seed: int, max_new: int,
            tree=None) -> Outcome:
        from tandem.params import GenerationRequest, SamplingParams

        request = GenerationRequest(
            prompt_ids=prompt_ids, max_new_tokens=max_new, num_draft_tokens=k, ignore_eos=True,
            sampling=SamplingParams(temperature=temperature, seed=seed), speculate=mode != TARGET_ONLY, tree=tree,
        )
        result = self.generator.generate(request, overlap=self.overlap)
        return _outcome(result.token_ids, result.stats)

    def close(self) -> None:
        pass


def _outcome(token_ids: list[int], s: dict) -> Outcome:
    return Outcome(len(token_ids), s["num_rounds"], s["num_accepted_tokens"], s["accepted_per_position"],
                   drafted=s["num_draft_tokens"], tree_rounds=s.get("num_tree_rounds", 0),
                   shed_rounds=s.get("num_rounds_load_shed", 0),
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
        cache = kwargs.get("cache", kwargs.get("past_key_values"))  # transformers >= 5.24 calls it `cache`
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
        # each verify forward reads the last committed token and the drafts (the first: the prompt and the drafts)
        drafted = forwards[0][0] - len(prompt_ids) + sum(n - 1 for n, _ in forwards[1:]) if forwards else 0
        return Outcome(new, len(forwards), new - len(forwards), _accepted_per_position(forwards, len(prompt_ids),
                                                                                       new, k), drafted)

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
