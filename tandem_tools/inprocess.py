"""Both engines in one process, stepped by the coordinator's scheduler (coordinator/scheduler.py) over links
that call them directly: the reference that service tests compare to, and `tandem generate --in-process`.
Concurrent generations share its batches as they do through the services."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

from pydantic import BaseModel

from coordinator.scheduler import Scheduler
from draft_server.engine import DraftEngine
from tandem.constraint import Grammars
from tandem.defaults import DECODE_STEPS, SPEC_DRAFT_COST
from tandem.gates import AcceptanceGate, TreeGate
from tandem.pairing import TargetShape, check_pair
from tandem.params import GenerationRequest
from tandem.policy import Speculation
from tandem.rounds import FIXED_K, RoundEvent
from target_server.engine import TargetEngine

MAX_RUNNING = 64  # generations in one batch (the coordinator's --max-sessions default); more wait their turn
MAX_WAITING = 1024


class EngineLink:
    """The scheduler's link to an engine in this process (protocol.TargetBackend, DraftBackend). A batch runs
    on the scheduler's thread when `receive` asks for it; a draft batch `beside` a target batch of the same step
    runs on the draft's own thread meanwhile, so an ahead goes beside its verify as on two services. Alone it
    runs on the scheduler's thread too: a thread hand-off a step slowed a lone generation."""

    typed = True  # results as the engine gives them: no wire to unpack
    transport = "in-process"
    generation = 1  # one "stream" for its life: its sessions are never lost with one

    def __init__(self, service: str, engine, beside: EngineLink | None = None):
        self.service, self.engine = service, engine
        self._beside = beside  # the link whose batch this one's may run beside
        self._pool: ThreadPoolExecutor | None = None
        self._deferred: tuple[list, list[str]] | None = None  # sent, to run at receive()
        self._pending = None

    def send(self, steps: Sequence, releases: Sequence[str] = ()) -> None:
        work = (list(steps), list(releases))
        if self._beside is not None and self._beside._deferred is not None and work[0]:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix=f"tandem-{self.service}")
            self._pending = self._pool.submit(self._run, *work)
        else:
            self._deferred = work

    def _run(self, steps: list, releases: list[str]) -> list:
        for session_id in releases:
            self.engine.release(session_id)
        if not steps:
            return []
        try:
            return self.engine.run(steps)
        except Exception as exc:  # noqa: BLE001 - an engine that fails the whole batch fails each of its steps
            return [exc] * len(steps)

    def receive(self) -> list:
        if self._deferred is not None:
            work, self._deferred = self._deferred, None
            return self._run(*work)
        return self._pending.result()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)


def scheduler_over(target, draft, max_context: int | None, speculation: Speculation, grammars: Grammars | None = None,
                   max_running: int = MAX_RUNNING, max_waiting: int = MAX_WAITING) -> Scheduler:
    """A scheduler stepping these engines (protocol.TargetBackend, DraftBackend or None)."""
    to_target = EngineLink("target", target)
    return Scheduler(to_target, EngineLink("draft", draft, beside=to_target) if draft is not None else None,
                     list(target.eos_token_ids), max_context, speculation, max_running, max_waiting,
                     grammars=grammars, vocab_size=getattr(target, "vocab_size", None))


def run_rounds(target, draft, request: GenerationRequest, max_context: int | None = None,
               speculation: Speculation = FIXED_K, grammars: Grammars | None = None) -> Iterator[RoundEvent]:
    """One generation over these engines, the scheduler with a batch of one. Closing the iterator early (a
    client went away, a stop string matched) releases both sessions."""
    scheduler = scheduler_over(target, draft, max_context, speculation, grammars, max_running=1, max_waiting=0)
    handle = scheduler.submit(request)
    try:
        yield from handle.events()
    finally:
        handle.cancel()
        scheduler.close()


class GenerationResult(BaseModel):
    token_ids: list[int]  # generated tokens only
    text: str | None = None
    finish_reason: str
    stats: dict


def target_shape(engine: TargetEngine) -> TargetShape:
    return TargetShape(vocab_size=engine.vocab_size, hidden_size=engine.hidden_size, num_layers=engine.num_layers)


class InProcessGenerator:
    def __init__(
        self,
        target_dir: str | Path,
        draft_dir: str | Path | None = None,
        device: str = "cpu",
        draft_device: str | None = None,
        dtype: str = "float32",
        draft_cost: float = SPEC_DRAFT_COST,
        aux_layer_convention: str | None = None,
        tree_policy: bool = True,
    ):
        """`draft_cost`: the acceptance gate's cost of a draft token (the coordinator's is
        defaults.SPEC_DRAFT_COST); 0 turns the gate off (every round drafts the request's K). `tree_policy`: a
        request with a draft tree runs, each round, the tree or its chain, whichever has measured faster
        (as the coordinator does); off: the tree every round.
        `aux_layer_convention`: how the head's layer ids count (tandem/aux_layers.py; None: its layout's)."""
        self.draft = None
        if draft_dir is not None:
            self.draft = DraftEngine(draft_dir, target_dir, device=draft_device or device, dtype=dtype,
                                     aux_layer_convention=aux_layer_convention)
        layer_ids = self.draft.config.aux_layer_ids if self.draft else None
        self.target = TargetEngine(target_dir, device=device, dtype=dtype, aux_layer_ids=layer_ids)
        if self.draft is not None:
            check_pair(target_shape(self.target), self.draft.shape())
        # one gate for the generator, as one for a coordinator: it learns from every generation
        self.speculation = Speculation(gate=AcceptanceGate(draft_cost) if draft_cost else None,
                                       trees=TreeGate() if tree_policy else None, decode_steps=DECODE_STEPS)
        self._tokenizer = None
        self._grammars: Grammars | None = None
        self.target_dir = Path(target_dir)
        self._stepper: Scheduler | None = None  # made at the first generation
        self._lock = threading.Lock()

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.target_dir)
        return self._tokenizer

    @property
    def grammars(self) -> Grammars | None:
        """Structured outputs over the target's tokenizer.json (None: it has none)."""
        if self._grammars is None:
            path = self.target_dir / "tokenizer.json"
            if not path.exists():
                return None
            self._grammars = Grammars(path.read_text(), self.target.vocab_size, self.target.eos_token_ids)
        return self._grammars

    def stream(self, request: GenerationRequest, overlap: bool = False) -> Iterator[RoundEvent]:
        """`overlap`: the draft prepares the next round while the target verifies (an ahead beside the verify).
        Generations streamed at once from several threads share the scheduler's batches."""
        grammars = self.grammars if request.grammar is not None else None  # made at the first that needs them
        handle = self._scheduler(grammars).submit(request, speculation=replace(self.speculation, overlap=overlap))
        try:
            yield from handle.events()
        finally:
            handle.cancel()  # a generation closed early: both sessions freed at the next step

    def _scheduler(self, grammars: Grammars | None) -> Scheduler:
        with self._lock:
            if self._stepper is None:
                self._stepper = scheduler_over(self.target, self.draft, self.target.max_context, self.speculation)
                # its thread holds the engines, not this generator: the scheduler stops when the generator is
                # dropped, so that its models are freed, or as the interpreter ends (no step left running then)
                self._stop = weakref.finalize(self, self._stepper.close)
            if grammars is not None:
                self._stepper.grammars = grammars
            self._stepper.eos_token_ids = list(self.target.eos_token_ids)  # as the target has them now
            return self._stepper

    def close(self) -> None:
        """Stop its scheduler (its thread and the engines' link threads)."""
        with self._lock:
            if self._stepper is not None:
                self._stop()  # the scheduler's close, and its links'
                self._stepper = None

    def generate(self, request: GenerationRequest, detokenize: bool = False, overlap: bool = False) -> GenerationResult:
        tokens: list[int] = []
        event = None
        for event in self.stream(request, overlap=overlap):
            tokens.extend(event.new_tokens)
        assert event is not None and event.finish_reason is not None
        text = self.tokenizer.decode(tokens, skip_special_tokens=True) if detokenize else None
        return GenerationResult(
            token_ids=tokens, text=text, finish_reason=event.finish_reason, stats=event.stats.as_dict()
        )


def compare(generator: InProcessGenerator, request: GenerationRequest, as_json: bool, overlap: bool = False) -> int:
    """`tandem generate --compare`: the request target-only, then with EAGLE-3 (after one short warm-up
    of each); prints the answer, both speeds and the speed-up. Greedy output is the same both ways."""
    import json
    import sys
    import time

    if generator.draft is None:
        raise ValueError("--compare needs a draft: give --draft (or --demo), without --no-speculation")
    warm = request.model_copy(update={"max_new_tokens": min(8, request.max_new_tokens)})
    runs = {}
    for name, speculate in (("target-only", False), ("eagle3", True)):
        generator.generate(warm.model_copy(update={"speculate": speculate}))
        t0 = time.perf_counter()
        result = generator.generate(request.model_copy(update={"speculate": speculate}), detokenize=True,
                                    overlap=overlap)
        seconds = time.perf_counter() - t0
        runs[name] = {"result": result, "seconds": seconds, "tokens_per_s": len(result.token_ids) / seconds}
    base, spec = runs["target-only"], runs["eagle3"]
    speedup = spec["tokens_per_s"] / base["tokens_per_s"]
    same = base["result"].token_ids == spec["result"].token_ids
    if as_json:
        print(json.dumps({"text": spec["result"].text, "token_ids": spec["result"].token_ids,
                          "finish_reason": spec["result"].finish_reason, "stats": spec["result"].stats,
                          "target_only_tokens_per_s": round(base["tokens_per_s"], 2),
                          "eagle3_tokens_per_s": round(spec["tokens_per_s"], 2),
                          "speedup": round(speedup, 3), "same_tokens": same}))
        return 0
    print(spec["result"].text)
    stats = spec["result"].stats
    print(f"[{len(spec['result'].token_ids)} tokens; target-only {base['tokens_per_s']:.1f} tokens/s, "
          f"EAGLE-3 {spec['tokens_per_s']:.1f} tokens/s: {speedup:.2f}x; mean acceptance length "
          f"{stats['mean_acceptance_length']:.2f}; "
          f"{'the same tokens as target-only' if same else 'tokens differ from target-only (sampling)'}]",
          file=sys.stderr)
    return 0
