"""The config reference: one markdown table per section (field, type, default, docstring).

A developer tool, apart from the runtime loader: everything is read from `config/schema.py` (types,
choices, defaults, and the docstring under each field, from its source). docs/config.md embeds the
reference between markers, and a test checks that it is up to date; after changing the schema run

    python -m single_controller.config.reference --write-docs

(without the flag it prints the reference; `sc-grpo config --reference` prints it too).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from single_controller.config import fields
from single_controller.config.schema import Config

__all__ = [
    "config_reference_markdown",
    "main",
    "readme_reference",
    "replace_readme_reference",
    "write_readme_reference",
]

_README_START = "<!-- config-reference:start -->"
_README_END = "<!-- config-reference:end -->"
_REPO_ROOT = Path(__file__).resolve().parents[2]
_COMMAND = "python -m single_controller.config.reference --write-docs"
_DOCS_PAGE = _REPO_ROOT / "docs" / "config.md"


def _yaml_scalar(value: Any) -> str:
    if isinstance(value, tuple):
        value = list(value)
    return yaml.safe_dump(value, default_flow_style=True, width=10_000).strip().removesuffix("...").strip()


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _section_rows(cls: type, docs: dict[str, dict[str, str]], missing: list[str]) -> list[str]:
    """The table rows of one section's own fields (a nested section gets its own table)."""
    rows = []
    cls_hints = fields.hints(cls)
    for f in dataclasses.fields(cls):
        tp = cls_hints[f.name]
        if fields.is_section(tp):
            continue
        doc = docs.get(cls.__name__, {}).get(f.name)
        if not doc:
            missing.append(f"{cls.__name__}.{f.name}")
            continue
        default = _yaml_scalar(fields.default_of(f))
        rows.append(f"| `{f.name}` | {_md_cell(fields.type_name(tp))} | `{_md_cell(default)}` | {_md_cell(doc)} |")
    return rows


def _sections(cls: type, prefix: str) -> list[tuple[str, type]]:
    """(dotted name, class) of `cls` and of every section nested in it, depth first."""
    out: list[tuple[str, type]] = [(prefix, cls)]
    hints = fields.hints(cls)
    for f in dataclasses.fields(cls):
        if fields.is_section(hints[f.name]):
            out += _sections(hints[f.name], f"{prefix}.{f.name}" if prefix else f.name)
    return out


def config_reference_markdown() -> str:
    """One markdown table per config section: field, type, default and the field's docstring."""
    docs = fields.field_docs()
    sections = _sections(Config, "")
    out = [
        f"<!-- generated from single_controller/config/schema.py by `{_COMMAND}`; do not edit by hand -->",
        "",
        "Set any field in the YAML file (`section:` then `field: value`) or on the command line as "
        "`section.field=value`, e.g. `sc-grpo run configs/embedded.yaml train.lr=3e-4 run.max_steps=50`. "
        "`sc-grpo config FILE [key=value ...]` validates and prints the resolved configuration.",
    ]
    missing: list[str] = []
    for name, cls in sections:
        rows = _section_rows(cls, docs, missing)
        title = f"### `{name}`" if name else "### Top level"
        out += ["", title, "", "| field | type | default | description |", "|---|---|---|---|", *rows]
    if missing:
        raise RuntimeError(f"config fields without a docstring in schema.py: {', '.join(missing)}")
    return "\n".join(out) + "\n"


def _markers(readme_text: str) -> tuple[int, int]:
    start = readme_text.find(_README_START)
    end = readme_text.find(_README_END)
    if start < 0 or end < start:
        raise ValueError(f"no '{_README_START}' ... '{_README_END}' section")
    return start, end


def replace_readme_reference(readme_text: str, reference: str) -> str:
    """`readme_text` with the text between the config-reference markers replaced by `reference`."""
    start, end = _markers(readme_text)
    head = readme_text[: start + len(_README_START)]
    return f"{head}\n{reference}{readme_text[end:]}"


def readme_reference(readme_text: str) -> str:
    """The text between the config-reference markers (what `replace_readme_reference` wrote)."""
    start, end = _markers(readme_text)
    return readme_text[start + len(_README_START) : end].removeprefix("\n")


def write_readme_reference(readme: Path = _DOCS_PAGE) -> bool:
    """Rewrite the config reference section of `readme` (docs/config.md); True if the file changed."""
    text = readme.read_text(encoding="utf-8")
    new = replace_readme_reference(text, config_reference_markdown())
    if new != text:
        readme.write_text(new, encoding="utf-8")
    return new != text


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m single_controller.config.reference",
        description="Print or refresh the generated config reference.",
    )
    parser.add_argument(
        "--write-docs",
        "--write-readme",
        dest="write_docs",
        nargs="?",
        const=str(_DOCS_PAGE),
        metavar="PAGE",
        help="rewrite the config reference section of docs/config.md (default: the repository's)",
    )
    args = parser.parse_args(argv)
    if args.write_docs:
        changed = write_readme_reference(Path(args.write_docs))
        print(f"{args.write_docs}: {'updated' if changed else 'already up to date'}")
    else:
        sys.stdout.write(config_reference_markdown())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
