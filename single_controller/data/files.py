"""Prompts from dataset files: JSONL, JSON and parquet, rendered to token ids with the model's tokenizer.

`read_records(path)` reads one file (parquet through `pyarrow`, JSON through the standard library,
which keeps chat messages as written). `file_prompts` makes `Prompt`s: the `data.prompt_key` column
(a string, or chat messages always rendered through the chat template), `data.answer_key`,
`data.id_key`; every other column rides along for the reward functions. A missing file or column,
a bad prompt, duplicate ids or a chat prompt without a template are refused naming file, row and
column; prompts over `data.max_prompt_tokens` are dropped and counted, or refused.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from single_controller.data import hub
from single_controller.data.tokenizer import NoChatTemplate, RunTokenizer
from single_controller.types import Prompt

SUFFIXES = (".jsonl", ".json", ".parquet")


class DatasetError(ValueError):
    """A dataset file or one of its rows cannot make prompts (named in the message)."""


@dataclass(frozen=True)
class LoadedPrompts:
    prompts: list[Prompt]
    too_long: int  # prompts dropped for exceeding data.max_prompt_tokens


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """Every row of a JSONL, JSON or parquet file, as dicts."""
    p = Path(path)
    if not p.is_file():
        raise DatasetError(f"dataset file {str(p)!r} does not exist")
    suffix = p.suffix.lower()
    if suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise DatasetError(f"{p}: reading parquet needs pyarrow (pip install 'sc-grpo[data]')") from None

        rows: list = pq.read_table(p).to_pylist()
    elif suffix == ".jsonl":
        rows = []
        for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except ValueError as e:
                    raise DatasetError(f"{p}:{n}: not a JSON object: {e}") from None
    elif suffix == ".json":
        try:
            data = json.loads(p.read_text(encoding="utf-8"))
        except ValueError as e:
            raise DatasetError(f"{p}: not JSON: {e}") from None
        listed = data.get("data") if isinstance(data, dict) else data
        if not isinstance(listed, list):
            raise DatasetError(f"{p}: a .json dataset is a list of objects (or {{'data': [...]}})")
        rows = listed
    else:
        raise DatasetError(f"dataset file {str(p)!r}: unknown format {suffix!r} (use one of {', '.join(SUFFIXES)})")
    for n, row in enumerate(rows, 1):
        if not isinstance(row, dict):
            raise DatasetError(f"{p}: row {n} is a {type(row).__name__}, not an object with columns")
    return rows


def dataset_records(entry: str, data_cfg, split: str) -> list[dict[str, Any]]:
    """Every row of one entry of `data.train_files` / `eval_files`: a file; a `datasets` `save_to_disk`
    directory (its `split`); or a Hub dataset repo id in the local cache (`data.subset`, `split`)."""
    p = Path(entry)
    if p.is_file():
        return read_records(p)
    if p.is_dir():
        return _saved_dataset(p, split)
    if hub.is_repo_id(entry) and p.suffix.lower() not in SUFFIXES:  # `data/train.jsonl` is a missing file
        try:
            snapshot = hub.resolve_repo(entry, data_cfg.revision, kind="dataset")
        except hub.HubNameError as e:
            raise DatasetError(str(e)) from None
        return [row for f in _hub_split_files(snapshot, entry, data_cfg.subset, split) for row in read_records(f)]
    return read_records(p)  # the error a missing file gets


def _saved_dataset(directory: Path, split: str) -> list[dict[str, Any]]:
    """The rows of a `Dataset.save_to_disk` directory (a `DatasetDict`'s: its `split`), read with pyarrow."""
    if (directory / "dataset_dict.json").is_file():
        directory = directory / split
        if not directory.is_dir():
            raise DatasetError(f"{directory.parent}: a saved DatasetDict without a {split!r} split")
    state = directory / "state.json"
    if not state.is_file():
        raise DatasetError(f"{directory}: a directory, but not a `datasets` save_to_disk one (no state.json)")
    import pyarrow as pa

    rows: list[dict[str, Any]] = []
    for f in json.loads(state.read_text())["_data_files"]:
        with pa.memory_map(str(directory / f["filename"])) as source:
            rows += pa.ipc.open_stream(source).read_all().to_pylist()
    return rows


def _hub_split_files(snapshot: Path, name: str, subset: str | None, split: str) -> list[Path]:
    """A cached Hub dataset's files of `split`, as the Hub lays out parquet conversions and most
    uploads: `<subset>/<split>-*`, `<subset>/<split>/*`, `data/<split>-*`, `<split>-*`."""
    folders = [snapshot / subset] if subset else [snapshot / "data", snapshot]
    for folder in folders:
        found = sorted(f for pattern in (f"{split}-*", f"{split}/*", f"{split}.*") for f in folder.glob(pattern))
        found = [f for f in found if f.suffix in SUFFIXES]
        if found:
            return found
    subsets = sorted(d.name for d in snapshot.iterdir() if d.is_dir() and d.name != "data")
    hint = f" (data.subset: one of {subsets})" if subsets and not subset else ""
    raise DatasetError(f"Hub dataset {name!r} has no {split!r} split files in {folders[0]}{hint}")


def _messages(value: Any, where: str) -> list[dict[str, Any]] | None:
    """`value` as chat messages, None when it is a string; refuses anything else."""
    if isinstance(value, str):
        return None
    if isinstance(value, Sequence) and value and all(isinstance(m, Mapping) for m in value):
        for m in value:
            if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise DatasetError(f"{where}: a chat message needs string 'role' and 'content', got {dict(m)!r}")
        return [dict(m) for m in value]
    raise DatasetError(f"{where}: the prompt is a {type(value).__name__}; expected a string or a list of messages")


def render_prompt(value: Any, data_cfg, tokenizer: RunTokenizer, where: str, tools: Any = None) -> list[int]:
    """Token ids of one prompt as the config says (chat template, with `tools` (`env.tools`), or raw)."""
    messages = _messages(value, where)
    if messages is None and not data_cfg.chat_template:
        return tokenizer.encode_prompt(value)
    if messages is None:
        messages = [{"role": "user", "content": value}]
    if data_cfg.system_prompt is not None and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": data_cfg.system_prompt}, *messages]
    try:
        return tokenizer.render_chat(messages, add_generation_prompt=True, tools=tools)
    except NoChatTemplate as e:
        raise DatasetError(f"{where}: {e}") from None


def _column(row: Mapping[str, Any], key: str, where: str) -> Any:
    if key not in row:
        raise DatasetError(f"{where}: no column {key!r} (columns: {sorted(row)})")
    return row[key]


def _row_prompt(
    row: Mapping[str, Any], data_cfg, tokenizer: RunTokenizer | None, where: str, default_id: str, tools: Any = None
) -> Prompt:
    raw = _column(row, data_cfg.prompt_key, where)
    answer = "" if data_cfg.answer_key is None else _column(row, data_cfg.answer_key, where)
    pid = default_id if data_cfg.id_key is None else str(_column(row, data_cfg.id_key, where))
    used = {data_cfg.prompt_key, data_cfg.answer_key, data_cfg.id_key}
    columns = {k: v for k, v in row.items() if k not in used}
    if tokenizer is None:  # checked, not rendered (the model directory is not written yet)
        _messages(raw, where)
        ids: list[int] = []
    else:
        ids = render_prompt(raw, data_cfg, tokenizer, where, tools)
    return Prompt(pid, tuple(ids), answer if isinstance(answer, str) else json.dumps(answer), raw, columns)


def gsm8k_row(row: Mapping[str, Any]) -> dict[str, Any]:
    """GSM8K's row (`question`, `answer`: the worked solution ending in `#### 72`) as a prompt row:
    `prompt` (the question), `answer` (the final number, thousands separators dropped: `72`),
    `solution` (the worked solution); other columns kept."""
    solution = str(_column(row, "answer", "gsm8k map"))
    head, sep, final = solution.rpartition("####")
    if not sep or not final.strip():
        raise DatasetError(f"gsm8k map: the answer {solution[-60:]!r} does not end in '#### <number>'")
    rest = {k: v for k, v in row.items() if k not in ("question", "answer")}
    return {
        **rest,
        "prompt": _column(row, "question", "gsm8k map"),
        "answer": final.strip().replace(",", ""),
        "solution": head.strip(),
    }


ROW_MAPS: dict[str, Callable[[Mapping[str, Any]], dict[str, Any]]] = {"gsm8k": gsm8k_row}


def row_map(spec: str | None) -> Callable[[Mapping[str, Any]], Mapping[str, Any]] | None:
    """`data.map`: a built-in (`ROW_MAPS`) or `module:function`; None: rows as read."""
    if spec is None:
        return None
    if spec in ROW_MAPS:
        return ROW_MAPS[spec]
    from single_controller.data.tasks import load_callable

    try:
        return load_callable(spec)
    except (ImportError, TypeError, ValueError) as e:
        raise DatasetError(f"data.map: {e} (built-ins: {', '.join(ROW_MAPS)})") from None


def _mapped(fn, row: Mapping[str, Any], where: str) -> Mapping[str, Any]:
    try:
        out = fn(dict(row))
    except DatasetError as e:
        raise DatasetError(f"{where}: {e}") from None
    except Exception as e:
        raise DatasetError(f"{where}: data.map failed on this row: {type(e).__name__}: {e}") from e
    if not isinstance(out, Mapping):
        raise DatasetError(f"{where}: data.map returned a {type(out).__name__}, not a row (a dict of columns)")
    return out


def file_prompts(
    files: Sequence[str], data_cfg, tokenizer: RunTokenizer | None, what: str, tools: Any = None
) -> LoadedPrompts:
    """The prompts of `files` (`dataset_records`: the split of `what`, train or eval) in order (ids
    unique over all of them), overlong ones dropped or refused, each row through `data.map` first.
    `tokenizer=None` checks the rows (columns, prompt shapes, ids) without rendering them."""
    from single_controller.data.tasks import check_unique_prompt_ids

    prompts: list[Prompt] = []
    too_long = 0
    limit = data_cfg.max_prompt_tokens
    fn = row_map(data_cfg.map)
    for f in files:
        split = data_cfg.eval_split if what == "data.eval_files" else data_cfg.split
        for n, record in enumerate(dataset_records(f, data_cfg, split), 1):
            where = f"{what} {f}, row {n}"
            row = record if fn is None else _mapped(fn, record, where)
            p = _row_prompt(row, data_cfg, tokenizer, where, f"{Path(f).stem}-{n:06d}", tools)
            if limit is not None and len(p.token_ids) > limit:
                if data_cfg.overlong_prompts == "error":
                    raise DatasetError(
                        f"{where}: the prompt has {len(p.token_ids)} tokens, more than data.max_prompt_tokens={limit} "
                        "(data.overlong_prompts=filter drops such prompts instead)"
                    )
                too_long += 1
                continue
            prompts.append(p)
    if not prompts:
        why = f" ({too_long} longer than {limit} tokens)" if too_long else ""
        raise DatasetError(f"{what} {list(files)}: no prompt left{why}")
    try:
        check_unique_prompt_ids(prompts, f"{what} {list(files)}")
    except ValueError as e:
        raise DatasetError(str(e)) from None
    return LoadedPrompts(prompts, too_long)
