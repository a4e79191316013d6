"""Mean acceptance length with a grammar against without it, and the grammar's cost per round, in-process.

    python bench/grammar_acceptance.py [--demo | --target DIR --draft DIR --prompts FILE] [-n 16] [-k 4]

Both engines in this process (tandem_tools.inprocess), the acceptance gate off (every round drafts K): one
greedy generation per prompt, each prompt followed by a Python assignment whose value is a dict literal
(`\\n\\nDEFAULTS = `), where the demo target (trained on Python's standard library) writes JSON-like text.
Cases: no grammar; a JSON object (json_object); a JSON schema. Per case: mean acceptance length (tokens
committed per verify round, bonus included), drafts the grammar cut (it forbade them) and forced (it
allowed one token there), the round loop's seconds computing masks per round (tandem/constraint.py), and
the generation's tokens per second.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tandem.params import GenerationRequest, GrammarSpec
from tandem.stats import mean_acceptance_length
from tandem_tools.inprocess import InProcessGenerator
from tandem_tools.profile import load_prompts

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                           "size": {"type": "integer", "minimum": 0, "maximum": 100000},
                                           "tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                                    "maxItems": 3}},
          "required": ["name", "size", "tags"], "additionalProperties": False}
CASES = {"none": None, "json_object": GrammarSpec(kind="json_object"),
         "json_schema": GrammarSpec(kind="json_schema", value=json.dumps(SCHEMA))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--demo", action="store_true")
    parser.add_argument("--target")
    parser.add_argument("--draft")
    parser.add_argument("--prompts")
    parser.add_argument("-n", type=int, default=16)
    parser.add_argument("-k", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args()
    if args.demo:
        demo = Path.home() / ".cache" / "tandem" / "demo"
        args.target, args.draft, args.prompts = demo / "target", demo / "draft", demo / "prompts.jsonl"
    generator = InProcessGenerator(args.target, args.draft, draft_cost=0)
    suffix = generator.tokenizer("\n\nDEFAULTS = ", add_special_tokens=False)["input_ids"]
    loaded = load_prompts(Path(args.prompts))[: args.n]
    prompts = [(p if isinstance(p, list) else generator.tokenizer(p)["input_ids"]) + suffix for p in loaded]
    generator.generate(GenerationRequest(prompt_ids=prompts[0], max_new_tokens=8))  # warm
    print(f"{'case':<12} {'MAL':>5} {'rounds':>6} {'cut':>5} {'forced':>6} {'mask ms/round':>13} {'tokens/s':>8}")
    for name, grammar in CASES.items():
        accepted = rounds = cut = forced = tokens = 0
        masks = seconds = 0.0
        for prompt in prompts:
            started = time.perf_counter()
            result = generator.generate(GenerationRequest(prompt_ids=prompt, max_new_tokens=args.max_new_tokens,
                                                          num_draft_tokens=args.k, grammar=grammar))
            seconds += time.perf_counter() - started
            stats = result.stats
            accepted += stats["num_accepted_tokens"]
            rounds += stats["num_rounds"]
            cut += stats["num_constrained_cuts"]
            forced += stats["num_forced_drafts"]
            masks += stats["constraint_seconds"]
            tokens += len(result.token_ids)
        print(f"{name:<12} {mean_acceptance_length(accepted, rounds):>5.2f} {rounds:>6} {cut:>5} {forced:>6} "
              f"{1000 * masks / max(rounds, 1):>13.3f} {tokens / seconds:>8.1f}")


if __name__ == "__main__":
    main()
