"""Dataset files (`data.train_files`): JSONL/JSON/parquet, chat templates, columns, clear errors."""

from __future__ import annotations

import json

import pytest

from single_controller.config.schema import DataConfig
from single_controller.data.bpe import write_bpe_tokenizer
from single_controller.data.files import DatasetError, file_prompts, read_records
from single_controller.data.tasks import TOKENIZER
from single_controller.data.tokenizer import load_tokenizer
from single_controller.preflight.loader import ConfigError, check_environment, load_config

ROWS = [
    {"id": "a", "prompt": [{"role": "user", "content": "123"}], "answer": "321", "level": 1},
    {"id": "b", "prompt": "456", "answer": 654, "level": 2},
]


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    d = tmp_path_factory.mktemp("bpe")
    write_bpe_tokenizer(d, 300)
    return load_tokenizer(str(d))


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_the_three_formats_read_the_same_rows(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [
        {"id": "a", "prompt": [{"role": "user", "content": "1"}], "answer": "1"},
        {"id": "b", "prompt": [{"role": "system", "content": "s"}, {"role": "user", "content": "2"}], "answer": "2"},
    ]
    jsonl = write_jsonl(tmp_path / "d.jsonl", rows)
    (tmp_path / "d.json").write_text(json.dumps(rows))
    (tmp_path / "w.json").write_text(json.dumps({"data": rows}))
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    for f in (jsonl, tmp_path / "d.json", tmp_path / "w.json", tmp_path / "d.parquet"):
        assert read_records(f) == rows, f


def test_chat_prompts_are_the_templates_token_ids_and_columns_ride_along(tmp_path, bpe):
    f = write_jsonl(tmp_path / "d.jsonl", ROWS)
    cfg = DataConfig(train_files=[f], id_key="id", system_prompt="Reverse.")
    a, b = file_prompts([f], cfg, bpe, "data.train_files").prompts
    chat = bpe.tok.apply_chat_template(
        [{"role": "system", "content": "Reverse."}, {"role": "user", "content": "123"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert chat.endswith("<|im_start|>assistant\n")
    assert list(a.token_ids) == bpe.tok.encode(chat, add_special_tokens=False)
    assert (a.prompt_id, a.answer, a.raw_prompt, dict(a.columns)) == ("a", "321", ROWS[0]["prompt"], {"level": 1})
    assert b.answer == "654" and b.raw_prompt == "456"  # a string prompt is one user message
    assert bpe.decode(b.token_ids) == "system\nReverse.\nuser\n456\nassistant\n"  # special tokens skipped
    raw = file_prompts([f], DataConfig(chat_template=False, id_key="id"), bpe, "x").prompts[1]
    assert list(raw.token_ids) == bpe.encode("456") and all(t in bpe.encode("0123456789") for t in raw.token_ids)


def test_digits_are_split_one_per_token(bpe):
    ids = bpe.encode("2026 is 1000")
    digits = [bpe.decode([i]) for i in ids if bpe.decode([i]).strip().isdigit()]
    assert digits == list("20261000")


@pytest.mark.parametrize(
    "rows, kwargs, match",
    [
        ([{"id": "a", "answer": "1"}], {}, r"row 1: no column 'prompt' \(columns: \['answer', 'id'\]\)"),
        ([{"id": "a", "prompt": "1"}], {}, r"row 1: no column 'answer'"),
        ([{"prompt": "1", "answer": "1"}], {}, r"row 1: no column 'id'"),
        (
            [{"id": "a", "prompt": 5, "answer": "1"}],
            {},
            r"the prompt is a int; expected a string or a list of messages",
        ),
        ([{"id": "a", "prompt": [{"role": "user"}], "answer": "1"}], {}, r"needs string 'role' and 'content'"),
        (
            [{"id": "a", "prompt": "1", "answer": "1"}, {"id": "a", "prompt": "2", "answer": "2"}],
            {},
            r"'a' \(2 times\)",
        ),
        ([{"id": "a", "prompt": "1" * 40, "answer": "1"}], {"overlong_prompts": "error"}, r"row 1: the prompt has \d+"),
    ],
)
def test_bad_rows_are_refused_naming_file_row_and_column(tmp_path, bpe, rows, kwargs, match):
    f = write_jsonl(tmp_path / "d.jsonl", rows)
    with pytest.raises(DatasetError, match=match):
        file_prompts([f], DataConfig(id_key="id", max_prompt_tokens=20, **kwargs), bpe, "data.train_files")


def test_overlong_prompts_are_dropped_and_counted(tmp_path, bpe):
    f = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "1" * n, "answer": ""} for n in (1, 30, 2, 40)])
    loaded = file_prompts([f], DataConfig(max_prompt_tokens=20), bpe, "data.train_files")
    assert [p.prompt_id for p in loaded.prompts] == ["d-000001", "d-000003"] and loaded.too_long == 2


def test_a_chat_prompt_for_a_tokenizer_without_a_template_is_refused(tmp_path):
    f = write_jsonl(tmp_path / "d.jsonl", ROWS[:1])
    with pytest.raises(DatasetError, match="has no chat template"):
        file_prompts([f], DataConfig(id_key="id"), TOKENIZER, "data.train_files")


def problem(*overrides: str) -> str:
    """The environment check's error for a config, its lines joined (messages wrap at 100 columns)."""
    with pytest.raises(ConfigError) as e:
        check_environment(load_config(None, list(overrides)))
    return " ".join(str(e.value).split())


def test_bad_dataset_files_are_one_clear_error_before_anything_starts(tmp_path):
    msg = problem(f"data.train_files=[{tmp_path / 'nope.jsonl'}]", "rollout.max_new_tokens=4")
    assert f"data.train_files: dataset file '{tmp_path / 'nope.jsonl'}' does not exist" in msg
    f = write_jsonl(tmp_path / "d.jsonl", ROWS)
    # the embedded model's character tokenizer has no chat template
    msg = problem(f"data.train_files=[{f}]", "data.id_key=id", "rollout.max_new_tokens=4")
    assert f"data.train_files {f}, row 1: the character tokenizer of the embedded model has no chat template" in msg
    (tmp_path / "x.csv").write_text("")
    msg = problem(f"data.eval_files=[{tmp_path / 'x.csv'}]", "eval.enabled=true")
    assert f"data.eval_files: dataset file '{tmp_path / 'x.csv'}': unknown format '.csv'" in msg


def test_the_dataloader_over_files_keeps_columns_and_its_exact_position(tmp_path, bpe):
    from single_controller.runtime.actor_host import PromptStream

    rows = [{"id": f"r{i}", "prompt": str(i), "answer": str(i)[::-1], "n": i} for i in range(7)]
    f = write_jsonl(tmp_path / "d.jsonl", rows)
    cfg = load_config(
        None, [f"data.train_files=[{f}]", "data.id_key=id", "data.chat_template=false", "rollout.max_new_tokens=2"]
    )
    stream = PromptStream(cfg)
    taken = [next(stream) for _ in range(10)]  # into the second epoch
    assert {p.prompt_id for p in taken[:7]} == {f"e0-r{i}" for i in range(7)}
    assert all(p.columns == {"n": int(p.raw_prompt)} and p.answer == p.raw_prompt[::-1] for p in taken)
    again = PromptStream(cfg)
    again.seek(6)
    assert [next(again) for _ in range(4)] == taken[6:]


def test_reasoning_gym_prompts_render_the_template_and_carry_the_item_for_its_scorer(tmp_path, bpe):
    pytest.importorskip("reasoning_gym", reason="the verifiers extra")
    from single_controller.data.reasoning_gym_source import rg_prompts
    from single_controller.data.verifiers import reasoning_gym

    over = [
        "data.reasoning_gym.task=spell_backward",
        "data.reasoning_gym.config={min_word_len: 3, max_word_len: 4}",
        "data.reasoning_gym.template='{metadata[word]}='",
        "data.reasoning_gym.size=20",
        "data.reasoning_gym.extract=full",
        "data.chat_template=false",
        "rollout.max_new_tokens=5",
    ]
    cfg = load_config(None, over)
    train, held = rg_prompts(cfg, bpe, "train").prompts, rg_prompts(cfg, bpe, "eval").prompts
    assert len(train) == 20 and len(held) == cfg.data.reasoning_gym.eval_size
    p = train[0]
    word = p.columns["entry"]["metadata"]["word"]
    assert p.raw_prompt == f"{word}=" and list(p.token_ids) == bpe.encode_prompt(f"{word}=") and p.answer == word[::-1]
    assert p.prompt_id == "rg-spell_backward-train-000000" and held[0].prompt_id == "rg-spell_backward-eval-000000"
    assert [t.columns["entry"] for t in train] != [h.columns["entry"] for h in held[:20]]  # another seed
    scored = reasoning_gym(
        [p.raw_prompt] * 2, [word[::-1], "zzzz"], entry=[p.columns["entry"]] * 2, extract=["full"] * 2
    )
    assert scored[0] == 1.0 and scored[1] < 1.0


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "data.reasoning_gym.task=spell_backwards",
            "unknown reasoning-gym task 'spell_backwards'; did you mean 'spell_backward'",
        ),
        (
            "data.reasoning_gym.template='{metadata[nope]}'",
            "data.reasoning_gym.template names 'nope', which the item lacks",
        ),
        ("data.reasoning_gym.config={nope: 1}", "task 'spell_backward' refused config {'nope': 1}"),
    ],
)
def test_bad_reasoning_gym_settings_are_one_clear_error_before_anything_starts(override, message):
    pytest.importorskip("reasoning_gym", reason="the verifiers extra")
    base = ["data.reasoning_gym.task=spell_backward", "rollout.max_new_tokens=5", "data.reasoning_gym.size=4"]
    msg = problem(*base, override)
    assert message in msg, msg


def test_a_resumed_prompt_comes_back_whole_from_the_source_and_a_changed_source_refuses_the_resume(tmp_path):
    """A checkpoint keeps a prompt's id, token ids and answer; its raw prompt and columns come back
    from the prompt source by id (`PromptStream.resolve`), so a column-reading reward sees the same
    prompt after a resume. A source that lost or changed one of them refuses the resume, naming it."""
    from replay.ledger import PromptLedger, unsettled_prompt_ids
    from single_controller.checkpoint import CheckpointError
    from single_controller.runtime.actor_host import PromptStream

    rows = [{"id": f"r{i}", "prompt": str(i), "answer": str(i)[::-1], "n": i} for i in range(7)]
    over = ["data.id_key=id", "data.chat_template=false", "rollout.max_new_tokens=2"]
    cfg = load_config(None, [f"data.train_files=[{write_jsonl(tmp_path / 'd.jsonl', rows)}]", *over])
    stream = PromptStream(cfg)
    ledger = PromptLedger(tmp_path / "history.jsonl")
    taken = [ledger.take(next(stream)).prompt for _ in range(9)]  # into the second epoch
    ledger.settle_trained([p.prompt_id for p in taken[:4]], 0)
    saved = json.loads(json.dumps(ledger.checkpoint_dict()))  # as a checkpoint writes and reads it
    unsettled = unsettled_prompt_ids(saved)
    assert list(unsettled) == [p.prompt_id for p in taken[4:]]

    resumed = PromptLedger.from_dict(saved, tmp_path / "history.jsonl", prompts=PromptStream(cfg).resolve(unsettled))
    back = [rec.prompt for rec in resumed.records()]
    assert back == taken[4:]  # Prompt equality leaves out the columns: compare them too
    assert [(p.raw_prompt, p.columns) for p in back] == [(p.raw_prompt, p.columns) for p in taken[4:]]
    assert all(p.columns == {"n": int(p.raw_prompt)} for p in back)

    lost = [r for r in rows if r["id"] != taken[5].prompt_id.partition("-")[2]]
    changed = [{**r, "answer": "x"} if r["id"] == taken[6].prompt_id.partition("-")[2] else r for r in lost]
    cfg2 = load_config(None, [f"data.train_files=[{write_jsonl(tmp_path / 'd2.jsonl', changed)}]", *over])
    with pytest.raises(CheckpointError) as e:
        PromptStream(cfg2).resolve(unsettled)
    assert f"not in the prompt source (1: {taken[5].prompt_id})" in str(e.value)
    assert f"changed in it (1: {taken[6].prompt_id})" in str(e.value)


GSM8K_ROWS = [
    {"question": "Tom has 3 apples and buys 4 more. How many?", "answer": "3 + 4 = <<3+4=7>>7\n#### 7"},
    {"question": "A farm sells 1,200 eggs a day. How many in 2 days?", "answer": "1200*2=2400\n#### 2,400"},
]


def test_the_gsm8k_map_makes_prompts_of_questions_and_answers_of_the_final_number(tmp_path, bpe):
    """data.map=gsm8k (issue #54 trap 2): GSM8K's answer column is a worked solution ending in
    `#### N`; the map makes N (thousands separators dropped) the answer a verifier compares with,
    the question the prompt, and keeps the solution as a column. A row without `####` is refused."""
    f = write_jsonl(tmp_path / "gsm8k.jsonl", GSM8K_ROWS)
    a, b = file_prompts([f], DataConfig(map="gsm8k"), bpe, "data.train_files").prompts
    assert (a.answer, a.raw_prompt) == ("7", GSM8K_ROWS[0]["question"])
    assert a.columns["solution"] == "3 + 4 = <<3+4=7>>7" and b.answer == "2400"
    with pytest.raises(DatasetError, match="no column 'prompt'"):
        file_prompts([f], DataConfig(), bpe, "data.train_files")  # unmapped: GSM8K has no prompt column
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"question": "q", "answer": "no final line"}])
    with pytest.raises(DatasetError, match=r"bad.jsonl, row 1: .*does not end in '#### <number>'"):
        file_prompts([bad], DataConfig(map="gsm8k"), bpe, "data.train_files")


def upper_prompt(row):
    return {**row, "prompt": row["prompt"].upper(), "answer": str(row["answer"])}


def test_a_user_map_runs_on_every_row_before_ids_are_checked_and_its_errors_name_the_row(tmp_path, bpe):
    rows = [{"prompt": "ab", "answer": 1, "id": "x"}, {"prompt": "cd", "answer": 2, "id": "x"}]
    f = write_jsonl(tmp_path / "d.jsonl", rows)
    here = "tests.unit.test_data_files"
    with pytest.raises(DatasetError, match="duplicated prompt id"):  # the map kept the ids: still caught
        file_prompts([f], DataConfig(map=f"{here}:upper_prompt", id_key="id"), bpe, "data.train_files")
    a, _ = file_prompts([f], DataConfig(map=f"{here}:upper_prompt"), bpe, "data.train_files").prompts
    assert a.raw_prompt == "AB" and a.answer == "1"
    with pytest.raises(DatasetError, match=r"data.map: .*built-ins: gsm8k"):
        file_prompts([f], DataConfig(map="no_such_module:fn"), bpe, "data.train_files")
    with pytest.raises(DatasetError, match=r"row 1: data.map failed on this row: TypeError"):
        file_prompts([f], DataConfig(map=f"{here}:GSM8K_ROWS.__getitem__"), bpe, "data.train_files")


def _gsm8k_cache(root, commit="c" * 40):
    """A Hub cache holding openai/gsm8k as the Hub stores it: parquet files of each split per subset."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    repo = root / "datasets--openai--gsm8k"
    for subset in ("main", "socratic"):
        (repo / "snapshots" / commit / subset).mkdir(parents=True)
        for split, rows in (("train", GSM8K_ROWS), ("test", GSM8K_ROWS[:1])):
            path = repo / "snapshots" / commit / subset / f"{split}-00000-of-00001.parquet"
            pq.write_table(pa.Table.from_pylist(rows), path)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return repo


def test_a_hub_dataset_name_reads_its_subsets_split_from_the_local_cache(tmp_path, bpe, monkeypatch):
    """data.train_files: [openai/gsm8k] (issue #54 trap 1), offline from a cache laid out on disk:
    data.subset picks the folder, data.split / eval_split the files; an ambiguous subset, a missing
    split and a name not in the cache are refused saying what to do."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.chdir(tmp_path)
    _gsm8k_cache(tmp_path / "hub")
    cfg = DataConfig(map="gsm8k", subset="main")
    train = file_prompts(["openai/gsm8k"], cfg, bpe, "data.train_files").prompts
    assert [p.answer for p in train] == ["7", "2400"] and train[0].prompt_id == "gsm8k-000001"
    assert [p.answer for p in file_prompts(["openai/gsm8k"], cfg, bpe, "data.eval_files").prompts] == ["7"]
    with pytest.raises(DatasetError, match=r"data.subset: one of \['main', 'socratic'\]"):
        file_prompts(["openai/gsm8k"], DataConfig(map="gsm8k"), bpe, "data.train_files")
    with pytest.raises(DatasetError, match="no 'validation' split"):
        file_prompts(["openai/gsm8k"], DataConfig(map="gsm8k", subset="main", split="validation"), bpe, "x")
    with pytest.raises(DatasetError, match=r"huggingface-cli download openai/other --repo-type dataset"):
        file_prompts(["openai/other"], cfg, bpe, "data.train_files")
    with pytest.raises(DatasetError, match="does not exist"):  # a file name, not a repo id
        file_prompts(["data/train.jsonl"], cfg, bpe, "data.train_files")


def test_a_save_to_disk_directory_is_read_by_split(tmp_path, bpe):
    datasets = pytest.importorskip("datasets")
    rows = {k: [r[k] for r in GSM8K_ROWS] for k in ("question", "answer")}
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_dict(rows), "test": datasets.Dataset.from_dict(rows).select([1])}
    ).save_to_disk(str(tmp_path / "saved"))
    got = file_prompts([str(tmp_path / "saved")], DataConfig(map="gsm8k"), bpe, "data.eval_files").prompts
    assert [p.answer for p in got] == ["2400"]
    datasets.Dataset.from_dict(rows).save_to_disk(str(tmp_path / "one"))
    got = file_prompts([str(tmp_path / "one")], DataConfig(map="gsm8k"), bpe, "data.train_files").prompts
    assert [p.answer for p in got] == ["7", "2400"]


def test_env_tools_reach_the_chat_template_as_its_tools(tmp_path):
    """env.tools (issue #54 item 4): the JSON tool schemas are the template's `tools` when prompts are
    rendered, so the policy sees them as its template writes tools; without them, nothing changes."""
    d = tmp_path / "tok"
    write_bpe_tokenizer(d, 300)
    tok = load_tokenizer(str(d))
    tok.tok.chat_template = (
        "{% if tools %}TOOLS {% for t in tools %}{{ t.function.name }} {% endfor %}\n{% endif %}"
        "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    )
    tools = [{"type": "function", "function": {"name": "lookup", "description": "find", "parameters": {}}}]
    f = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "hi", "answer": "x"}])
    (with_tools,) = file_prompts([f], DataConfig(), tok, "data.train_files", tools).prompts
    (plain,) = file_prompts([f], DataConfig(), tok, "data.train_files").prompts
    assert tok.decode(with_tools.token_ids).startswith("TOOLS lookup") and "TOOLS" not in tok.decode(plain.token_ids)
    cfg = load_config(None, ["env.tools=[{type: function, function: {name: lookup}}]"])
    assert cfg.env.tools[0]["function"]["name"] == "lookup"
