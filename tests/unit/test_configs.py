"""Every shipped config loads and validates; bad configs fail with one readable error listing all problems."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from single_controller.config import fields, reference
from single_controller.config.schema import Config, required_capacity, resolved_capacity
from single_controller.preflight import environment
from single_controller.preflight.loader import (
    BOUNDS,
    CHOICES,
    ConfigError,
    config_reference_markdown,
    config_to_yaml,
    load_config,
    readme_reference,
)
from single_controller.types import LossConfig

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    return str(path)


def flat(err: ConfigError) -> str:
    """The report with its line wrapping undone, for substring checks."""
    return " ".join(str(err).split())


def problems_of(path: str | None, overrides: list[str] = ()) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_config(path, list(overrides))
    return info.value


def _leaves(d: dict, prefix: str = ""):
    for k, v in d.items():
        if isinstance(v, dict):
            yield from _leaves(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


# ---------------------------------------------------------------- shipped configs


def test_the_shipped_configs_are_there():
    assert {p.name for p in CONFIGS} >= {"embedded.yaml", "embedded_sync.yaml", "sim.yaml"}


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_shipped_config_loads_and_validates(path: Path):
    cfg = load_config(str(path), [])
    assert isinstance(cfg, Config)
    assert resolved_capacity(cfg) >= required_capacity(cfg)


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_shipped_yaml_holds_only_differences_from_the_defaults(path: Path):
    import yaml

    data = yaml.safe_load(path.read_text()) or {}
    defaults = Config()
    same = [key for key, value in _leaves(data) if value == fields.get(defaults, key)]
    assert same == [], f"{path.name} restates defaults: {same}"


def test_embedded_is_the_streaming_async_default():
    cfg = load_config(str(ROOT / "configs/embedded.yaml"), [])
    assert (cfg.backend.generation, cfg.backend.trainer, cfg.storage.kind) == ("torch", "torch", "tq")
    assert (cfg.task.name, cfg.task.num_digits) == ("reverse_digits", 3)
    assert (cfg.rollout.group_size, cfg.train.groups_per_step, cfg.train.lr) == (16, 16, 1e-3)
    assert cfg.sampler.order == "in_order"
    assert (cfg.sampler.max_lookahead_versions, cfg.sampler.max_staleness_versions) == (1, 1)
    assert cfg.train.min_groups_per_chunk == 4
    assert (cfg.run.stop_at_success_rate, cfg.run.max_steps) == (0.9, 400)


def test_embedded_sync_differs_from_embedded_only_in_being_synchronous():
    asyn = load_config(str(ROOT / "configs/embedded.yaml"), [])
    sync = load_config(str(ROOT / "configs/embedded_sync.yaml"), [])
    assert sync.sampler.max_lookahead_versions == 0
    assert sync.sampler.max_staleness_versions == 0
    assert sync.train.min_groups_per_chunk == sync.train.groups_per_step
    expected = dataclasses.replace(
        asyn,
        run=dataclasses.replace(asyn.run, name=sync.run.name),
        sampler=dataclasses.replace(asyn.sampler, max_lookahead_versions=0, max_staleness_versions=0),
        train=dataclasses.replace(asyn.train, min_groups_per_chunk=asyn.train.groups_per_step),
    )
    assert sync == expected


def test_sim_uses_fake_workers_and_memory_storage():
    cfg = load_config(str(ROOT / "configs/sim.yaml"), [])
    assert (cfg.backend.generation, cfg.backend.trainer, cfg.storage.kind) == ("sim", "sim", "memory")
    assert cfg.backend.sim_generate_s < Config().backend.sim_generate_s
    assert cfg.backend.sim_train_s < Config().backend.sim_train_s


# ---------------------------------------------------------------- one readable error


def test_misspelled_key_is_one_problem_with_a_suggestion(tmp_path):
    err = problems_of(write(tmp_path, "train:\n  lrr: 0.1\n"))
    assert len(err.problems) == 1
    text = flat(err)
    assert "train.lrr" in text and "unknown key" in text
    assert "did you mean 'train.lr'?" in text
    assert "cfg.yaml" in text  # names where the value came from


def test_key_in_the_wrong_section_suggests_the_right_one():
    err = problems_of(None, ["run.lr=0.1"])
    assert len(err.problems) == 1
    assert "did you mean 'train.lr'?" in flat(err)


def test_misspelled_section_is_reported_once():
    err = problems_of(None, ["trian.lr=0.1"])
    assert len(err.problems) == 1
    assert "did you mean 'train'?" in flat(err)


def test_wrong_type_is_one_problem(tmp_path):
    err = problems_of(write(tmp_path, "train:\n  lr: fast\n"))
    assert len(err.problems) == 1
    assert "train.lr: expected float, got 'fast'" in flat(err)


@pytest.mark.parametrize(
    "override, expected",
    [
        ("run.progress_bar=5", "run.progress_bar: expected bool"),  # OmegaConf alone would take 5 as true
        ("train.groups_per_step=1.5", "train.groups_per_step: expected int"),
        ("train.groups_per_step=true", "train.groups_per_step: expected int"),
        ("run.max_steps=null", "run.max_steps: expected int"),
        ("train.betas=[0.9]", "train.betas: expected list of 2 floats"),
        ("train.betas=0.9", "train.betas: expected list of 2 floats"),
        ("run.name=[a, b]", "run.name: expected str"),
        ("train=5", "train: expected a mapping"),
    ],
)
def test_wrong_types_are_rejected(override, expected):
    err = problems_of(None, [override])
    assert len(err.problems) == 1, str(err)
    assert expected in flat(err)


def test_impossible_capacity_explains_the_deadlock(tmp_path):
    err = problems_of(write(tmp_path, "buffer:\n  capacity_groups: 16\n"))
    assert len(err.problems) == 1
    text = flat(err)
    assert "buffer.capacity_groups (16)" in text
    assert "(L+1) * train.groups_per_step" in text and "32" in text
    assert "deadlock" in text
    assert max(len(line) for line in str(err).splitlines()[1:]) <= 100  # wrapped for a terminal


def test_capacity_exactly_the_requirement_is_fine():
    cfg = load_config(
        None, ["buffer.capacity_groups=48", "sampler.max_lookahead_versions=2", "sampler.max_staleness_versions=2"]
    )
    assert resolved_capacity(cfg) == 48 == required_capacity(cfg)


def test_several_problems_are_all_listed_in_one_error(tmp_path):
    path = write(
        tmp_path,
        "train:\n  lrr: 0.1\n  lr: fast\nbuffer:\n  capacity_groups: 16\nrollout:\n  on_failure: ignore\n",
    )
    err = problems_of(path, ["metrics.port=70000", "nonsense"])
    text = flat(err)
    assert len(err.problems) == 6, text
    for needle in (
        "train.lrr",
        "train.lr: expected float",
        "buffer.capacity_groups",
        "rollout.on_failure",
        "metrics.port",
        "'nonsense' is not of the form key=value",
    ):
        assert needle in text
    lines = str(err).splitlines()
    assert lines[0].endswith("6 problems")
    assert sum(line.startswith("  - ") for line in lines) == 6  # one bullet per problem
    assert "Traceback" not in text


@pytest.mark.parametrize(
    "overrides, paths",
    [
        (["rollout.group_size=1"], "rollout.group_size"),
        (["rollout.on_failure=ignore"], "rollout.on_failure"),
        (["train.loss_agg=batch"], "train.loss_agg"),
        (["train.loss_level=token"], "train.loss_level"),  # retired: named with its replacement
        (["train.is_truncation=2.0"], "train.is_truncation"),
        (["train.policy_loss=grpo"], "train.policy_loss"),
        (["train.is_correction=token_truncate", "train.recompute_old_logprobs=false"], "train.recompute_old_logprobs"),
        (["train.is_correction=token_mask", "train.is_threshold_low=1.5"], "train.is_threshold_low"),
        (["train.is_threshold_low=0.5"], "train.is_threshold_low"),  # only the mask corrections have one
        (["train.kl_estimator=k4"], "train.kl_estimator"),
        (["train.policy_loss=gspo"], "train.recompute_old_logprobs"),  # the ratio is 1: gspo == ppo_clip
        (["train.clip_eps_high=0.28"], "train.recompute_old_logprobs"),  # ... and no clip binds
        (["train.updates_per_step=3"], "train.updates_per_step"),  # 16 groups do not split in 3
        (["reward.kl_coef=0.1", "backend.colocate=true", "backend.colocate_form=turns"], "reward.kl_coef"),
        (["reward.overlong_buffer=3"], "reward.overlong_buffer"),  # the embedded task's 3 new tokens: none left
        (["reward.overlong_buffer=1", "env.fn=guess"], "reward.overlong_buffer"),  # an episode's length differs
        (["sampler.order=lifo"], "sampler.order"),
        (["sync.drain_policy=wait"], "sync.drain_policy"),
        (["backend.generation=gpu"], "backend.generation"),
        (["backend.trainer=deepspeed"], "backend.trainer"),
        (["backend.generation=sim"], "backend.trainer"),  # sim is both roles or neither
        (["backend.trainer=sim"], "backend.generation"),
        (["storage.kind=redis"], "storage.kind"),
        (["storage.kind=memory"], "storage.kind"),  # memory needs the sim backends
        (["train.groups_per_step=0"], "train.groups_per_step"),
        (["timeouts.generate_s=0"], "timeouts.generate_s"),
        (["sync.drain_timeout_s=-1"], "sync.drain_timeout_s"),
        (["rollout.max_new_tokens=0"], "rollout.max_new_tokens"),
        (["train.lr=0"], "train.lr"),
        (["train.betas=[0.9, 1.0]"], "train.betas"),
        (["rollout.top_p=0"], "rollout.top_p"),
        (["run.stop_at_success_rate=1.5"], "run.stop_at_success_rate"),
        (["ray.num_cpus=0"], "ray.num_cpus"),
        (["sampler.max_staleness_versions=0"], "sampler.max_staleness_versions"),
        (["train.min_groups_per_chunk=17"], "train.min_groups_per_chunk"),
        (["backend.num_trainer_ranks=65"], "backend.num_trainer_ranks"),  # 4 groups * 16 rows = 64
        (["model.max_seq_len=7"], "model.max_seq_len"),  # 3 digits + 2 + 3 new tokens = 8
        (["model.n_heads=3"], "model.n_heads"),
        (["metrics.port=65536"], "metrics.port"),
        (["metrics.port=-1"], "metrics.port"),
        (["task.reward_fn=score"], "task.reward_fn"),
        (["run.name=a/b"], "run.name"),
    ],
)
def test_each_check_rejects_its_violation(overrides, paths):
    err = problems_of(None, overrides)
    assert len(err.problems) == 1, str(err)
    assert paths in err.problems[0].paths
    assert paths in flat(err)


@pytest.mark.parametrize(
    "overrides",
    [
        ["rollout.group_size=2"],
        ["storage.kind=memory", "backend.generation=sim", "backend.trainer=sim"],
        ["backend.generation=vllm", "model.path=m"],  # loads anywhere: packages and the dir are checked at run
        ["backend.trainer=megatron", "model.path=m"],  # the layout and the machine are checked at run
        ["sampler.max_staleness_versions=3"],
        ["train.min_groups_per_chunk=16"],
        ["backend.num_trainer_ranks=64"],
        ["model.max_seq_len=8"],
        ["metrics.port=0"],
        ["metrics.port=65535"],
        [
            "task.name=single_controller.data.tasks:reverse_digits",
            "model.max_seq_len=4",
        ],  # the digit rule is for digit tasks only
        ["run.stop_at_success_rate=1.0"],
        ["reward.overlong_buffer=2", "reward.overlong_penalty=0.5", "train.mask_truncated=true"],
        ["train.updates_per_step=4", "train.policy_loss=gspo", "train.clip_eps_high=0.28"],  # the ratio moves
        ["reward.kl_coef=0.05", "reward.kl_estimator=k3"],
    ],
)
def test_boundary_values_pass(overrides):
    load_config(None, overrides)


def test_checks_on_a_rejected_value_are_not_piled_on():
    # lookahead "two" is rejected; the capacity check would otherwise judge it with the default L
    err = problems_of(None, ["sampler.max_lookahead_versions=two", "buffer.capacity_groups=16"])
    assert [p.paths for p in err.problems] == [("sampler.max_lookahead_versions",)]


@settings(max_examples=60, deadline=None)
@given(
    lookahead=st.integers(0, 4),
    groups=st.integers(1, 32),
    capacity=st.integers(1, 200),
)
def test_capacity_is_rejected_exactly_below_the_requirement(lookahead, groups, capacity):
    overrides = [
        f"sampler.max_lookahead_versions={lookahead}",
        f"sampler.max_staleness_versions={lookahead}",
        f"train.groups_per_step={groups}",
        f"train.min_groups_per_chunk={min(4, groups)}",
        f"buffer.capacity_groups={capacity}",
    ]
    if capacity >= (lookahead + 1) * groups:
        assert load_config(None, overrides).buffer.capacity_groups == capacity
    else:
        err = problems_of(None, overrides)
        assert [p.paths[0] for p in err.problems] == ["buffer.capacity_groups"]


def test_unreadable_and_malformed_files_are_config_errors(tmp_path):
    err = problems_of(str(tmp_path / "missing.yaml"))
    assert "cannot read config file" in flat(err)
    err = problems_of(write(tmp_path, "train: [1,\n"))
    assert "not valid YAML" in flat(err)
    err = problems_of(write(tmp_path, "- 1\n- 2\n"))
    assert "mapping" in flat(err)


def test_interpolations_resolve_and_bad_ones_are_reported():
    cfg = load_config(None, ["train.min_groups_per_chunk=${train.groups_per_step}"])
    assert cfg.train.min_groups_per_chunk == 16
    err = problems_of(None, ["train.lr=${train.nope}", "train.kl_coef=${run.name}"])
    assert [p.paths for p in err.problems] == [("train.lr",), ("train.kl_coef",)]


# ---------------------------------------------------------------- overrides


def test_overrides_apply_after_the_file_in_order(tmp_path):
    path = write(tmp_path, "train:\n  lr: 0.01\nrun:\n  max_steps: 9\n")
    cfg = load_config(
        path,
        [
            "train.lr=3e-4",
            "run.max_steps=7",
            "run.max_steps=8",
            "train.betas=[0.5, 0.6]",
            "ray.num_cpus=3",
            "run.name=x",
        ],
    )
    assert cfg.train.lr == 3e-4
    assert cfg.run.max_steps == 8
    assert cfg.train.betas == (0.5, 0.6)  # a tuple, like the default
    assert cfg.ray.num_cpus == 3
    assert cfg.run.name == "x"
    assert cfg.model == Config().model  # untouched sections keep their defaults


def test_defaults_only_and_null_sections(tmp_path):
    assert load_config(None, []) == Config()
    assert load_config(write(tmp_path, "# nothing\ntrain:\n"), []) == Config()


def test_loaded_config_is_frozen():
    cfg = load_config(None, [])
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.train.lr = 1.0  # type: ignore[misc]


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_config_to_yaml_round_trips(path: Path, tmp_path):
    cfg = load_config(str(path), ["train.betas=[0.8, 0.9]", "buffer.capacity_groups=100"])
    dumped = tmp_path / "dumped.yaml"
    dumped.write_text(config_to_yaml(cfg))
    assert load_config(str(dumped), []) == cfg


# ---------------------------------------------------------------- the tables and the reference


def _numeric_leaf_paths() -> list[str]:
    out = []
    for path, _, tp in fields.leaf_fields():
        inner = fields.base_type(tp)
        if typing.get_origin(inner) is tuple and fields.item_section(inner) is None:
            inner = fields.base_type(typing.get_args(inner)[0])  # a list of numbers or choices, not of mappings
        if inner in (int, float):
            out.append(path)
    return out


def test_every_numeric_field_has_declared_bounds():
    assert sorted(_numeric_leaf_paths()) == sorted(BOUNDS)


def test_choices_name_real_fields_and_defaults_are_valid_choices():
    defaults = Config()
    for path, choices in CHOICES.items():
        value = fields.get(defaults, path)
        assert set(value if isinstance(value, tuple) else [value]) <= set(choices), path


def test_reference_documents_every_field():
    md = config_reference_markdown()
    for path, f, _ in fields.leaf_fields():
        section = path.rsplit(".", 1)[0] if "." in path else None
        assert f"| `{f.name}` |" in md, path
        if section:
            assert f"### `{section}`" in md
    # docstrings come from config.py's source, not from somewhere else
    assert "Completions per prompt (G)" in md
    assert "| `capacity_groups` | int or null | `null` |" in md
    assert "| `on_failure` | `retry` / `drop` | `retry` |" in md


def test_docs_config_reference_is_in_sync():
    page = (ROOT / "docs" / "config.md").read_text()
    assert readme_reference(page) == config_reference_markdown(), (
        "docs/config.md is stale: run `python -m single_controller.config.reference --write-docs`"
    )


def test_write_docs_rewrites_only_the_marked_section(tmp_path):
    readme = tmp_path / "config.md"
    readme.write_text("# T\nintro\n<!-- config-reference:start -->\nold stuff\n<!-- config-reference:end -->\ntail\n")
    assert reference.main(["--write-docs", str(readme)]) == 0
    text = readme.read_text()
    assert text.startswith("# T\nintro\n<!-- config-reference:start -->\n")
    assert text.endswith("<!-- config-reference:end -->\ntail\n")
    assert "old stuff" not in text
    assert readme_reference(text) == config_reference_markdown()
    assert reference.write_readme_reference(readme) is False  # idempotent


@pytest.mark.parametrize(
    "override, path, words",
    [
        ("task.name=revers_digits", "task.name", "did you mean 'reverse_digits'"),
        ("task.reward_fn=nosuch_mod_xyz:f", "task.reward_fn", "cannot import module 'nosuch_mod_xyz'"),
        ("task.reward_fn=single_controller.data.tasks:nope", "task.reward_fn", "has no attribute 'nope'"),
        ("model.checkpoint=/nonexistent/ckpt", "model.checkpoint", "does not exist"),
    ],
)
def test_names_that_do_not_resolve_are_config_errors_before_anything_starts(override, path, words):
    with pytest.raises(ConfigError) as info:
        load_config(str(ROOT / "configs/embedded.yaml"), [override])
    (problem,) = info.value.problems
    assert problem.paths == (path,) and words in problem.message


# ---------------------------------------------------------------- what the machine must have


def test_default_backends_need_nothing_more():
    assert environment.environment_problems(Config()) == []


def test_a_backend_whose_package_is_missing_names_its_extra(monkeypatch):
    from single_controller.backends import registry

    monkeypatch.setitem(
        registry.TRAINER_BACKENDS,
        "megatron",
        registry.BackendEntry("sc_grpo_absent.ray_workers:start", ("sc_grpo_absent_pkg",), "megatron"),
    )
    cfg = load_config(None, ["backend.trainer=megatron"])  # loading never needs the package
    (problem,) = environment.environment_problems(cfg)
    assert problem.paths == ("backend.trainer",)
    assert "sc_grpo_absent_pkg" in problem.message and "'.[megatron]'" in problem.message
    with pytest.raises(ConfigError, match=r"install the `megatron` extra"):
        environment.check_environment(cfg)


def test_the_config_package_uses_no_private_api_of_its_libraries():
    """OmegaConf's (or anyone's) private names change without notice: `_set_flag`, `_get_node`..."""
    import ast

    bad = []
    for path in sorted((ROOT / "single_controller/config").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Attribute):
                names = [node.attr]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or "", *(a.name for a in node.names)]
            bad += [f"{path.name}:{node.lineno}: {n}" for n in names if n.startswith("_") and not n.startswith("__")]
    assert bad == []


def test_a_number_given_for_a_text_field_is_that_text():
    cfg = load_config(None, ["run.name=2024", "model.path=7"])
    assert cfg.run.name == "2024" and cfg.model.path == "7"
    with pytest.raises(ConfigError, match="run.max_steps: expected int"):
        load_config(None, ["run.max_steps=abc"])


def test_a_mapping_valued_field_is_replaced_by_a_later_layer_not_merged(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("data:\n  reasoning_gym:\n    config: {min_word_len: 3, max_word_len: 4}\n")
    assert load_config(str(f), []).data.reasoning_gym.config == {"min_word_len": 3, "max_word_len": 4}
    assert load_config(str(f), ["data.reasoning_gym.config={}"]).data.reasoning_gym.config == {}
    assert load_config(str(f), ["data.reasoning_gym.config={size: 5}"]).data.reasoning_gym.config == {"size": 5}


@pytest.mark.parametrize(
    "key, replacement",
    [("train.loss_level=sequence", "seq_mean_token_mean"), ("train.is_truncation=0", "recompute_old_logprobs=false")],
)
def test_a_retired_key_is_refused_naming_what_replaced_it(key, replacement):
    text = flat(problems_of(None, [key]))
    assert "no longer a key" in text and replacement in text


def test_the_loss_menu_is_read_from_the_config():
    from single_controller.preflight.algorithm import loss_config

    cfg = load_config(
        None,
        [
            "train.loss_agg=seq_mean_token_sum_norm",
            "rollout.max_new_tokens=7",
            "train.policy_loss=gspo",
            "train.clip_eps=0.2",
            "train.clip_eps_high=0.28",
            "train.recompute_old_logprobs=false",
            "train.is_correction=none",
            "train.kl_coef=0.01",
            "train.kl_estimator=k2",
        ],
    )
    loss = loss_config(cfg)
    assert (loss.agg, loss.norm_tokens, loss.policy_loss) == ("seq_mean_token_sum_norm", 7, "gspo")
    assert (loss.clip_low, loss.clip_high, loss.ratio_to_gen, loss.is_correction) == (0.2, 0.28, True, "none")
    assert (loss.kl_coef, loss.kl_estimator) == (0.01, "k2")
    masked = ["train.is_correction=sequence_mask", "train.is_threshold_low=0.5", "train.is_threshold=3"]
    loss = loss_config(load_config(None, masked))
    assert (loss.is_correction, loss.is_low, loss.is_high, loss.ratio_to_gen) == ("sequence_mask", 0.5, 3.0, False)
    # the defaults are the loss before the menu: token mean, PPO clip 0.2, TIS at 2, no KL
    assert loss_config(load_config(None, [])) == LossConfig()
