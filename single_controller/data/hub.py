"""Hugging Face Hub names from the local cache, offline: `model.path: Qwen/Qwen2.5-1.5B-Instruct`.

A name that is not a directory here but has the shape of a repo id (`org/name`) is looked up in the
Hub cache the way `huggingface_hub` lays it out (`models--org--name/refs/<revision>` holds a commit,
`snapshots/<commit>/` the files), in `HF_HUB_CACHE`, else `HF_HOME/hub`, else
`~/.cache/huggingface/hub`. Nothing is downloaded: a name not in the cache is an error that names
the directories looked at and the command that downloads it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
COMMIT = re.compile(r"^[0-9a-f]{40}$")


class HubNameError(ValueError):
    """A repo id that is not in the local Hugging Face cache (the message says what to do)."""


def hub_cache_dirs() -> list[Path]:
    """Where the Hub cache is, in the order `huggingface_hub` reads its settings."""
    if os.environ.get("HF_HUB_CACHE"):
        return [Path(os.environ["HF_HUB_CACHE"]).expanduser()]
    if os.environ.get("HF_HOME"):
        return [Path(os.environ["HF_HOME"]).expanduser() / "hub"]
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return [base / "huggingface" / "hub"]


def is_repo_id(name: str) -> bool:
    """`org/name`, and no such directory here (a local directory always wins)."""
    return bool(REPO_ID.match(name)) and not Path(name).exists()


def resolve_repo(name: str, revision: str | None = None, kind: str = "model") -> Path:
    """The cached snapshot directory of repo `name` at `revision` (a branch, a tag or a commit;
    None: `main`). `kind`: `model` or `dataset` (their cache folders differ)."""
    folder = f"{kind}s--{name.replace('/', '--')}"
    ref = revision or "main"
    looked: list[str] = []
    for cache in hub_cache_dirs():
        repo = cache / folder
        looked.append(str(repo))
        ref_file = repo / "refs" / ref
        commit = ref_file.read_text().strip() if ref_file.is_file() else ref if COMMIT.match(ref) else None
        if commit is not None and (repo / "snapshots" / commit).is_dir():
            return repo / "snapshots" / commit
    at = "" if revision is None else f" at revision {revision!r}"
    flag = "" if revision is None else f" --revision {revision}"
    repo_type = "" if kind == "model" else f" --repo-type {kind}"
    raise HubNameError(
        f"{name!r} is not a directory here, and the Hugging Face cache has no {kind} {name!r}{at} "
        f"(looked in {', '.join(looked)}; set HF_HUB_CACHE or HF_HOME to use another cache). Nothing is "
        f"downloaded during a run: download it first with `huggingface-cli download {name}{repo_type}{flag}` "
        "(or give a local directory)"
    )
