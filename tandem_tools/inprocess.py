"""Both engines in one process, driven by the same round loop as the coordinator: the reference
that service tests compare to, and `tandem generate --in-process`."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

from pydantic import BaseModel

from draft_server.engine import DraftEngine
from tandem.constraint import Grammars
from tandem.defaults import DECODE_STEPS, SPEC_DRAFT_COST
from tandem.gates import AcceptanceGate, TreeGate
from tandem.pairing import TargetShape, check_pair
from tandem.params import GenerationRequest
from tandem.policy import Speculation
from tandem.rounds import RoundEvent, run_rounds
from target_server.engine import TargetEngine


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
        """`overlap`: the draft's ahead steps run on a worker thread while the target verifies."""
        speculation = replace(self.speculation, overlap=overlap)
        grammars = self.grammars if request.grammar is not None else None
        return run_rounds(self.target, self.draft, request, self.target.max_context, speculation, grammars)

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
