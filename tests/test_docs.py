"""The README and docs/ say only what exists: code that compiles, commands the parser knows, config keys the configs
have, links to files that are there, API names that resolve to the objects vitkit exports.

`make docs` (mkdocs build --strict) checks the links between pages and the API reference as the site is built;
these tests check the same pages as Markdown, as a code host shows them, without building anything.
"""

from __future__ import annotations

import dataclasses
import importlib
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

import vitkit
from vitkit.cli import build_parser
from vitkit.models import BiTConfig, ResNetConfig, ViTConfig
from vitkit.train.config import MODEL_SECTION_KEYS, SECTIONS, describe_config

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
RESULTS = ROOT / "benchmarks" / "results"
PAGES = [README, *sorted(DOCS.rglob("*.md"))]

FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
SPAN = re.compile(r"`([^`\n]+)`")
OVERRIDE = re.compile(r"(?<![\w.])(model|data|optim|schedule|run|mpp)\.(\w+)=")


def page_id(path: Path) -> str:
    return str(path.relative_to(ROOT))


def fences(path: Path, *langs: str) -> list[str]:
    return [body for lang, body in FENCE.findall(path.read_text()) if lang in langs]


def prose(path: Path) -> str:
    """The page without its fenced blocks."""
    return FENCE.sub("", path.read_text())


def subcommands() -> set[str]:
    parser = build_parser()
    action = next(a for a in parser._actions if a.dest == "command")
    return set(action.choices)


def slug(heading: str) -> str:
    """The anchor of a heading, as GitHub and mkdocs' toc both spell it for plain headings."""
    text = re.sub(r"[`*]", "", heading).strip().lower()
    return re.sub(r"\s+", "-", re.sub(r"[^\w\s-]", "", text))


def anchors(path: Path) -> set[str]:
    return {slug(h) for h in re.findall(r"^#{1,6} (.+)$", prose(path), re.M)}


@pytest.mark.parametrize("path", [README, *sorted(DOCS.glob("*.md"))], ids=page_id)
def test_python_blocks_compile(path: Path) -> None:
    for body in fences(path, "python"):
        compile(body, str(path), "exec")


def command_lines(body: str) -> list[list[str]]:
    """The `vitkit ...` invocations of a shell block, comments dropped (torchrun's `-m vitkit.cli` included)."""
    found = []
    for line in body.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        for i, word in enumerate(words):
            if word == "vitkit" or (word == "vitkit.cli" and i and words[i - 1] == "-m"):
                found.append(words[i + 1 :])
                break
    return found


@pytest.mark.parametrize("path", [README, *sorted(DOCS.glob("*.md"))], ids=page_id)
def test_shell_commands_parse(path: Path) -> None:
    """Every command of a shell block is accepted by the real parser (nothing runs)."""
    parser = build_parser()
    for body in fences(path, "bash", "sh", "console"):
        for argv in command_lines(body):
            argv = [a for a in argv if a != "..."]
            try:
                _, extra = parser.parse_known_args(argv)
            except SystemExit:  # argparse has printed why
                pytest.fail(f"{path.name}: `vitkit {shlex.join(argv)}` does not parse")
            # key=value items after an option are the command's overrides, as vitkit.cli.main takes them
            assert all("=" in e and not e.startswith("-") for e in extra), (path.name, argv, extra)


@pytest.mark.parametrize("path", PAGES, ids=page_id)
def test_inline_commands_exist(path: Path) -> None:
    """`vitkit name ...` in the prose names a real subcommand (COMMAND or ..., placeholders, are not names)."""
    known = subcommands()
    for span in SPAN.findall(prose(path)):
        m = re.match(r"vitkit ([a-z]\w*)", span)
        if m:
            assert m.group(1) in known, (path.name, span)


def test_cli_page_lists_every_command() -> None:
    """docs/cli.md's table names every subcommand, and only real ones."""
    (table,) = [b for b in fences(DOCS / "cli.md", "text") if b.startswith("vitkit ")]
    listed = {line.split()[1] for line in table.splitlines() if line.startswith("vitkit ")}
    listed.discard("--version")
    assert listed == subcommands()


def config_keys() -> set[str]:
    model_fields = {f.name for cls in (ViTConfig, ResNetConfig, BiTConfig) for f in dataclasses.fields(cls)}
    keys = {f"model.{name}" for name in {*MODEL_SECTION_KEYS, *model_fields}}
    for section, cls in SECTIONS.items():
        if section != "model":
            keys |= {f"{section}.{f.name}" for f in dataclasses.fields(cls)}
    return keys


@pytest.mark.parametrize("path", PAGES, ids=page_id)
def test_config_overrides_exist(path: Path) -> None:
    """Every `section.key=value` a page writes is a key of the training config."""
    keys = config_keys()
    for section, key in OVERRIDE.findall(path.read_text()):
        if key == "key":  # the placeholder of `section.key=value`
            continue
        assert f"{section}.{key}" in keys, (path.name, f"{section}.{key}")


def test_cli_page_lists_every_config_key() -> None:
    """The copy of `vitkit config`'s output in docs/cli.md has exactly the keys the command prints today."""
    (block,) = [b for b in fences(DOCS / "cli.md", "text") if b.startswith("model.name")]
    documented = [line.split()[0] for line in block.splitlines()]
    printed = [line.split()[0] for line in describe_config().splitlines()]
    assert documented == printed


@pytest.mark.parametrize("path", PAGES, ids=page_id)
def test_relative_links_resolve(path: Path) -> None:
    """Every relative link points to a file that exists, and an anchor to a heading of that page."""
    for target in LINK.findall(prose(path)):
        if re.match(r"[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        assert dest.exists(), (path.name, target)
        if anchor and dest.suffix == ".md" and "reference" not in dest.parts:
            assert anchor in anchors(dest), (path.name, target)


def test_layout_names_existing_modules() -> None:
    """docs/layout.md names only files and folders the repository has, and in a folder's lines only its files."""
    (block,) = fences(DOCS / "layout.md", "text")
    folder = None
    for line in block.splitlines():
        if line.strip() and not line.startswith(" "):
            head = line.split()[0]
            assert (ROOT / head).exists(), head
            folder = head if head.endswith("/") else None
            rest = line[len(head) :]
        else:
            rest = line
        if folder is not None:
            for name in re.findall(r"\b\w+\.(?:py|css|js)\b", rest):
                assert (ROOT / folder / name).exists(), f"{folder}{name}"


@pytest.mark.parametrize(("path", "limit"), [(README, 140), (DOCS / "speed.md", 400)], ids=["README", "speed"])
def test_page_within_its_length(path: Path, limit: int) -> None:
    """The README is a front page and docs/speed.md today's table, not diaries: the history is git log."""
    lines = len(path.read_text().splitlines())
    assert lines <= limit, f"{page_id(path)} has {lines} lines; at most {limit}"


def test_make_test_says_how_long_and_shows_its_progress(tmp_path: Path) -> None:
    """The README says how long `make test` takes beside the command, and the pytest call of the Makefile's recipe
    (run here on two one-test files, with the project's pytest settings) runs them in its two workers and prints
    the share of the suite done."""
    assert re.search(r"^make test +#.*about \d+ minutes", README.read_text(), re.M)
    makefile = (ROOT / "Makefile").read_text()
    recipe = re.search(r"^test:.*\n\t(.*)$", makefile, re.M)
    workers = re.search(r"^TEST_WORKERS \?= (\d+)$", makefile, re.M)
    assert recipe is not None and workers is not None and workers.group(1) == "2"
    command = recipe.group(1).replace("$(PY)", sys.executable).replace("$(TEST_WORKERS)", workers.group(1))
    command = shlex.split(command.replace("$(PYTEST_ARGS)", ""))
    for name in ("a", "b"):
        (tmp_path / f"test_{name}.py").write_text("def test_it():\n    pass\n")
    settings = ["-c", str(ROOT / "pyproject.toml"), "--rootdir", str(tmp_path), "-p", "no:cacheprovider"]
    out = subprocess.run([*command, *settings, str(tmp_path)], capture_output=True, text=True, cwd=tmp_path).stdout
    assert "2 workers [2 items]" in out and re.search(r"^\.\. +\[100%\]$", out, re.M), out


@pytest.mark.parametrize("path", PAGES, ids=page_id)
def test_transcripts_are_the_recorded_output_of_the_commands_beside_them(path: Path) -> None:
    """What a page shows training print (a block with its `final held-out` line) is preceded by a link to the
    benchmarks/results file of the run that printed it: every line of the block is in that file, and its last
    `command:` is a command of the shell block just before the transcript."""
    text = path.read_text()
    blocks = list(FENCE.finditer(text))
    for i, block in enumerate(blocks):
        if "final held-out" not in block.group(2):
            continue
        where = f"{page_id(path)}, the transcript at line {text.count(chr(10), 0, block.start()) + 1}"
        links = re.findall(r"benchmarks/results/([\w.-]+\.md)\)", text[blocks[i - 1].end() if i else 0 : block.start()])
        assert links, f"{where}: no link to the benchmarks/results file it comes from just before it"
        record = (RESULTS / links[-1]).read_text()
        missing = [line for line in block.group(2).splitlines() if line not in record.splitlines()]
        assert not missing, f"{where}: lines not in {links[-1]}: {missing}"
        commands = re.findall(r"^- command: `(?:vitkit )?(.+)`$", record, re.M)
        assert commands, f"{links[-1]}: no `command:` item"
        shown = command_lines(blocks[i - 1].group(2)) if i and blocks[i - 1].group(1) in ("bash", "sh") else []
        assert shlex.split(commands[-1]) in shown, f"{where}: `{commands[-1]}` is not in the shell block before it"


def test_results_files_say_how_they_were_made() -> None:
    """Every file of benchmarks/results/ but its README holds its command, machine and date (its header items)."""
    files = [p for p in sorted(RESULTS.glob("*.md")) if p.name != "README.md"]
    for path in files:
        text = path.read_text()
        for key in ("command", "machine", "date"):
            assert re.search(rf"^(?:- )?{key}: \S", text, re.M), f"{page_id(path)}: no '{key}:' line"


def test_reference_covers_the_public_api() -> None:
    """Each exported name has an entry headed `vitkit.NAME` whose `::: module.path` is the very object vitkit
    exports, so the generated reference can neither miss a public name nor document a stale one."""
    entries = {}
    for path in sorted((DOCS / "reference").glob("*.md")):
        for target, heading in re.findall(
            r"^::: ([\w.]+)\n    options:\n      heading: ([\w.]+)$", path.read_text(), re.M
        ):
            entries[heading] = target
    for heading, target in entries.items():
        module, _, name = target.rpartition(".")
        assert getattr(vitkit, heading.removeprefix("vitkit.")) is getattr(importlib.import_module(module), name)
    public = {name for name in vitkit.__all__ if name not in ("__version__", "MODELS")}
    assert {f"vitkit.{name}" for name in public} <= set(entries)
