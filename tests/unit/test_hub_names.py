"""Hub repo ids in `model.path`, from the local Hugging Face cache laid out on disk (issue #54 trap 1):
resolved to the snapshot of a branch, a tag or a commit; a local directory wins; a missing one is
refused naming the directories looked at and the command that downloads it."""

from __future__ import annotations

import pytest

from single_controller.config.problems import ConfigError
from single_controller.data import hub
from single_controller.preflight.environment import model_directory, with_cached_model
from single_controller.preflight.loader import load_config

MAIN, V1 = "a" * 40, "b" * 40


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    """A Hub cache as huggingface_hub lays it out: org/tiny at `main` and at tag `v1`."""
    root = tmp_path / "hf-home" / "hub"
    repo = root / "models--org--tiny"
    for commit in (MAIN, V1):
        (repo / "snapshots" / commit).mkdir(parents=True)
        (repo / "snapshots" / commit / "config.json").write_text("{}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(MAIN + "\n")
    (repo / "refs" / "v1").write_text(V1)
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.chdir(tmp_path)
    return repo


def test_a_repo_id_resolves_to_its_cached_snapshot_at_each_revision(cache):
    for revision, commit in ((None, MAIN), ("v1", V1), (V1, V1)):
        cfg = with_cached_model(load_config(None, ["model.path=org/tiny", f"model.revision={revision or 'null'}"]))
        assert cfg.model.path == str(cache / "snapshots" / commit)
    assert model_directory(load_config(None, ["model.path=org/tiny"])) == []


def test_hf_hub_cache_wins_over_hf_home(cache, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "elsewhere"))
    assert hub.hub_cache_dirs() == [tmp_path / "elsewhere"]
    with pytest.raises(hub.HubNameError, match="elsewhere/models--org--tiny"):
        hub.resolve_repo("org/tiny")


def test_a_missing_repo_or_revision_names_where_it_looked_and_the_download_command(cache):
    with pytest.raises(ConfigError) as e:
        with_cached_model(load_config(None, ["model.path=org/other"]))
    text = " ".join(str(e.value).split())
    assert "models--org--other" in text and "huggingface-cli download org/other`" in text
    with pytest.raises(ConfigError, match="--revision v2"):
        with_cached_model(load_config(None, ["model.path=org/tiny", "model.revision=v2"]))
    (problem,) = model_directory(load_config(None, ["model.path=org/other"]))
    assert "Nothing is downloaded during a run" in problem.message


def test_a_local_directory_of_that_name_wins_and_model_create_keeps_its_path(cache, tmp_path):
    (tmp_path / "org" / "tiny").mkdir(parents=True)
    assert not hub.is_repo_id("org/tiny")
    assert with_cached_model(load_config(None, ["model.path=org/tiny"])).model.path == "org/tiny"
    created = load_config(None, ["model.path=org/new", "model.create=true"])
    assert with_cached_model(created).model.path == "org/new"
