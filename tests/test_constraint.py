"""Structured outputs, min_tokens and the penalties in the round loop: greedy output with speculation is the
target's alone under the same constraint, a grammar's text matches it, a bad grammar is refused by name.
The sampled laws are checked in tests/test_speculative_sampling.py."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from tandem.constraint import Constraint, Grammars, unpack_rows
from tandem.errors import InvalidRequest
from tandem.params import GenerationRequest, GrammarSpec, SamplingParams, TreeParams

PROMPT = [17, 250, 33, 104, 9, 12]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
          "required": ["name", "age", "tags"], "additionalProperties": False}
GRAMMARS = {
    "json_schema": GrammarSpec(kind="json_schema", value=json.dumps(SCHEMA)),
    "json_object": GrammarSpec(kind="json_object"),
    "regex": GrammarSpec(kind="regex", value="[a-z]{2,8}( [a-z]{2,8}){0,3}\\."),
    "choice": GrammarSpec(kind="choice", value=json.dumps(["red", "green", "blue"])),
    "grammar": GrammarSpec(kind="grammar", value='start: "(" NUM ("+" NUM)* ")"\nNUM: /[0-9]{1,3}/'),
}


@pytest.fixture(scope="module")
def grammars(generator) -> Grammars:
    return generator.grammars


def run(generator, **fields) -> tuple[list[int], dict]:
    result = generator.generate(GenerationRequest(prompt_ids=PROMPT, max_new_tokens=48, **fields))
    return result.token_ids, result.stats


def text_of(generator, ids: list[int]) -> str:
    return generator.tokenizer.decode([i for i in ids if i not in generator.target.eos_token_ids])


@pytest.mark.parametrize("kind", list(GRAMMARS))
def test_greedy_constrained_output_is_the_targets_alone(generator, kind):
    grammar = GRAMMARS[kind]
    alone, _ = run(generator, grammar=grammar, speculate=False)
    drafted, stats = run(generator, grammar=grammar, num_draft_tokens=4)
    assert drafted == alone
    assert stats["num_rounds"] > 0
    text = text_of(generator, drafted)
    if kind == "json_schema":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif kind == "json_object":  # free-form JSON: the tiny model may run to max_new_tokens inside a string
        matcher = generator.grammars.matcher(grammar)
        assert matcher.consume_tokens(drafted[:-1] if drafted[-1] in generator.target.eos_token_ids else drafted)
        assert text.startswith("{")
    elif kind == "regex":
        assert re.fullmatch(grammar.value, text), text
    elif kind == "choice":
        assert text in ("red", "green", "blue")
    else:
        assert re.fullmatch(r"\([0-9]{1,3}(\+[0-9]{1,3})*\)", text), text


def test_a_grammar_forces_drafts_and_cuts_forbidden_ones(generator):
    """The tiny head drafts free text: the grammar cuts it, and where one token is allowed drafts it."""
    _, stats = run(generator, grammar=GRAMMARS["json_schema"], num_draft_tokens=4)
    assert stats["num_constrained_cuts"] > 0 and stats["num_forced_drafts"] > 0
    assert stats["constraint_seconds"] > 0


def test_a_constrained_tree_gives_the_targets_tokens(generator):
    grammar = GRAMMARS["regex"]
    alone, _ = run(generator, grammar=grammar, speculate=False)
    tree, _ = run(generator, grammar=grammar, tree=TreeParams(nodes=12, depth=3, top_k=3))
    assert tree == alone


@pytest.mark.parametrize("penalty", [{"presence_penalty": 1.5}, {"frequency_penalty": 1.0},
                                     {"repetition_penalty": 1.5}, {"repetition_penalty": 0.7},
                                     {"presence_penalty": -1.0, "frequency_penalty": 0.5}])
def test_greedy_penalised_output_is_the_targets_alone(generator, penalty):
    sampling = SamplingParams(**penalty)
    alone, _ = run(generator, sampling=sampling, speculate=False, ignore_eos=True)
    drafted, _ = run(generator, sampling=sampling, ignore_eos=True)
    tree, _ = run(generator, sampling=sampling, ignore_eos=True, tree=TreeParams(nodes=12, depth=3, top_k=3))
    assert drafted == alone == tree
    plain, _ = run(generator, speculate=False, ignore_eos=True)
    assert alone != plain  # the penalty changed the text


def test_a_prefill_of_produced_tokens_counts_them_as_generated(generator):
    """A preempted generation's recompute: a prefill of the prompt and what it produced, with output_start
    where they begin, leaves the penalties' state and the next token as the prefill and verifies that
    produced them did; output_start outside the prompt is refused by name."""
    engine = generator.target
    sampling = SamplingParams(presence_penalty=1.5, frequency_penalty=1.0, repetition_penalty=1.3)
    token = engine.prefill("made", PROMPT, sampling, want_features=False).token
    produced = []
    for _ in range(12):
        produced.append(token)
        token = engine.verify("made", token, [], False).bonus
    made = engine.sessions.get("made")
    resumed = engine.prefill("resumed", [*PROMPT, *produced], sampling, want_features=False,
                             output_start=len(PROMPT))
    again = engine.sessions.get("resumed")
    try:
        assert resumed.token == token
        assert torch.equal(again.counts, made.counts) and torch.equal(again.prompt_seen, made.prompt_seen)
        with pytest.raises(InvalidRequest, match="output_start"):
            engine.prefill("bad", PROMPT, sampling, output_start=len(PROMPT) + 1)
    finally:
        engine.release("made")
        engine.release("resumed")


def test_min_tokens_holds_the_stop_ids_back(generator):
    eos = generator.target.eos_token_ids[0]
    free, _ = run(generator, speculate=False, stop_token_ids=[PROMPT[0]])
    # the generation ends at the first stop id of a free run; min_tokens pushes every stop past its count
    stop = free[2]
    early, _ = run(generator, speculate=False, stop_token_ids=[stop])
    assert early[-1] == stop and len(early) <= 3
    held_alone, _ = run(generator, speculate=False, stop_token_ids=[stop], min_tokens=10)
    held, _ = run(generator, stop_token_ids=[stop], min_tokens=10)
    assert held == held_alone
    assert len(held) >= 10 and stop not in held[:9] and eos not in held[:9]


def test_a_bad_grammar_is_refused_naming_it(grammars):
    with pytest.raises(InvalidRequest, match="regex"):
        grammars.matcher(GrammarSpec(kind="regex", value="[a-"))
    with pytest.raises(InvalidRequest, match="JSON schema is not JSON"):
        grammars.matcher(GrammarSpec(kind="json_schema", value='{"type": '))
    with pytest.raises(InvalidRequest, match="JSON schema"):
        grammars.matcher(GrammarSpec(kind="json_schema", value='{"type": "frob"}'))
    with pytest.raises(InvalidRequest, match="choice"):
        grammars.matcher(GrammarSpec(kind="choice", value="[]"))
    with pytest.raises(InvalidRequest, match="grammar"):
        grammars.matcher(GrammarSpec(kind="grammar", value="start: nothing_defined"))


def test_each_grammar_is_compiled_once(grammars):
    spec = GrammarSpec(kind="regex", value="[0-9]{4}")
    grammars.matcher(spec)
    compiled = grammars._compiled[(spec.kind, spec.value)]
    grammars.matcher(spec)
    assert grammars._compiled[(spec.kind, spec.value)] is compiled


def test_the_chain_walk_rolls_back_and_commits(grammars, generator):
    """Walking a verify's drafts leaves the matcher where the committed text left it."""
    encode = lambda text: generator.tokenizer(text, add_special_tokens=False)["input_ids"]
    vocab = generator.target.vocab_size
    constraint = Constraint(grammars.matcher(GRAMMARS["choice"]), vocab, generator.target.eos_token_ids)
    before = constraint.first()
    good, bad = encode("green"), encode("purple")
    kept, forced, rows = constraint.chain(bad)
    assert kept == 0 and len(unpack_rows(rows, vocab)) == 1 + len(forced)
    assert constraint.first() == before  # rolled back
    kept, forced, rows = constraint.chain(good, room=8)
    assert kept == len(good) and forced == []
    allowed = unpack_rows(rows, vocab)
    assert allowed[-1][generator.target.eos_token_ids[0]]  # the choice is complete: EOS may end it
    constraint.commit(good)
    assert constraint.matcher.is_accepting()


def test_a_stop_id_among_the_drafts_leaves_the_matcher_where_the_text_left_it(grammars, generator):
    """A chain that drafts the grammar's end and EOS after it: the walk stops at the stop id (walking the
    matcher into it and back would leave it at the end), so after committing less the end is not allowed."""
    encode = lambda text: generator.tokenizer(text, add_special_tokens=False)["input_ids"]
    vocab, eos = generator.target.vocab_size, generator.target.eos_token_ids[0]
    constraint = Constraint(grammars.matcher(GRAMMARS["choice"]), vocab, generator.target.eos_token_ids)
    word = encode("green")
    kept, _, rows = constraint.chain([*word, eos, word[0]])
    assert kept == len(word) + 1  # the stop id is kept (the target may accept it), nothing after it
    assert len(unpack_rows(rows, vocab)) == kept + 1
    constraint.commit(word[:1])
    assert not unpack_rows(constraint.first(), vocab)[0][eos]
    walk = constraint.walk()
    for token in [*word[1:], eos, word[0]]:
        walk.row()
        walk.take(token)
    assert walk.taken == len(word) - 1 and walk.ended
    walk.close()
    assert not unpack_rows(constraint.first(), vocab)[0][eos]


@pytest.mark.parametrize("kind", ["json_schema", "regex", "choice"])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_the_draft_picks_its_drafts_from_its_q_masked_by_the_grammar(generator, grammars, kind, sampled):
    """A constrained draft session walks its own matcher: every draft is one the grammar allows after the
    committed text and the drafts before it (unless its row allows no token of the draft's vocabulary: the
    round loop cuts the chain there), and a sampled draft's q has no mass outside its row."""
    import torch

    from tandem.protocol import DraftConstraint, Propose

    engine, vocab, eos = generator.draft, generator.target.vocab_size, generator.target.eos_token_ids
    spec = GRAMMARS[kind]
    in_draft = torch.zeros(vocab, dtype=torch.bool)
    in_draft[engine.model.to_target_ids(torch.arange(engine.draft_vocab))] = True
    sampling = SamplingParams(temperature=1.0, seed=3) if sampled else None
    first = int(unpack_rows(Constraint(grammars.matcher(spec), vocab, eos).first(), vocab)[0].nonzero()[0][0])
    checked = 0
    for n in range(6):
        torch.manual_seed(n)
        session = f"masked-{kind}-{sampled}-{n}"
        committed = [*PROMPT[1:], first]  # the prefill's token, one the grammar allows
        drafts = engine.run([Propose(session, torch.randn(len(committed), engine.feature_size), committed, 5,
                                     open=True, sampling=sampling,
                                     constraint=DraftConstraint(spec, 0, eos, output_tokens=1))])[0]
        constraint = Constraint(grammars.matcher(spec), vocab, eos)
        constraint.commit([first])
        for j, d in enumerate(drafts):
            row = torch.from_numpy(unpack_rows(constraint.first(), vocab)[0])
            if not (row & in_draft).any():
                break  # nothing of the draft's vocabulary allowed here: unmasked, and cut by the loop
            assert row[d], (kind, n, j, d)
            if drafts.q is not None:
                assert all(row[i] for i, p in zip(drafts.q[j].ids, drafts.q[j].probs) if p > 0)
            checked += 1
            if d in eos:
                break
            constraint.commit([d])
        engine.release(session)
    assert checked >= 6
