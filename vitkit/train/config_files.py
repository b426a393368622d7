"""Config files: YAML read strictly (a key given twice is an error), the configs shipped in vitkit/configs (the
first line of each header comment is the purpose ``vitkit train --help`` lists), and what ``--data`` names."""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from ..data.config import FILE_SOURCES, SOURCES, source_section
from ..errors import UserError, UserFileNotFoundError
from .config import SECTIONS


def shipped_configs() -> dict[str, Path]:
    """The configs shipped in vitkit/configs, by stem: digits, vit_b16_pretrain, vit_b16_finetune, ..."""
    folder = resources.files("vitkit") / "configs"
    return {Path(p.name).stem: Path(str(p)) for p in folder.iterdir() if p.name.endswith(".yaml")}


def resolve_config_path(name_or_path: str) -> Path:
    """A YAML path, or the stem of a shipped config (``digits``)."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    shipped = shipped_configs()
    if name_or_path in shipped:
        return shipped[name_or_path]
    raise UserFileNotFoundError(
        f"config {name_or_path!r}: no such file, and not a shipped config ({', '.join(shipped)})"
    )


# far above any config or sweep spec, far below what exhausts memory or fills a terminal with one error line
MAX_YAML_BYTES = 1 << 20
MAX_YAML_VALUES = 10_000


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.safe_load's loader, except that a key given twice in one mapping is an error (PyYAML silently keeps the
    last); keys brought in by a merge (``<<: *defaults``) may still be overridden."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        first_line: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=deep)
            try:
                earlier = first_line.get(key)
            except TypeError:  # an unhashable key: the base class reports it
                continue
            if earlier is not None:
                raise yaml.constructor.ConstructorError(
                    problem=f"duplicate key {key!r} (first given on line {earlier})", problem_mark=key_node.start_mark
                )
            first_line[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


def _yaml_problem(error: yaml.YAMLError) -> str:
    """A YAML error in one line: where and what (PyYAML's own text spans several, with a snippet of the file)."""
    if isinstance(error, yaml.MarkedYAMLError) and error.problem_mark is not None:
        mark = error.problem_mark
        return f"line {mark.line + 1}, column {mark.column + 1}: {error.problem}"
    return " ".join(str(error).split())


def _expanded_values(node: yaml.Node, limit: int) -> int:
    """How many values a composed document holds with its aliases expanded (a few lines of aliases can stand for
    billions: the "billion laughs"), counted up to limit + 1, which a node that contains itself also gets."""
    sizes: dict[int, int] = {}

    def size(n: yaml.Node) -> int:
        if id(n) not in sizes:
            sizes[id(n)] = limit + 1  # until counted: met again on the way, it contains itself
            children = [c for pair in n.value for c in pair] if isinstance(n, yaml.MappingNode) else n.value
            sizes[id(n)] = min(limit + 1, 1 + (sum(map(size, children)) if isinstance(n, yaml.CollectionNode) else 0))
        return sizes[id(n)]

    return size(node)


def read_yaml(path: Path, what: str = "a YAML config") -> Any:
    """A YAML file's document (safe_load's semantics, a key given twice in one mapping refused), bounded before it
    is built: at most MAX_YAML_BYTES, and MAX_YAML_VALUES with its aliases expanded."""
    if (size := path.stat().st_size) > MAX_YAML_BYTES:
        raise UserError(f"{path}: {size:,} bytes; {what} is at most {MAX_YAML_BYTES:,} bytes")
    try:
        loader = _UniqueKeyLoader(path.read_text(encoding="utf-8"))
        node = loader.get_single_node()
        if node is not None and _expanded_values(node, MAX_YAML_VALUES) > MAX_YAML_VALUES:
            raise UserError(
                f"{path}: more than {MAX_YAML_VALUES:,} values with each alias (*name) counted as what it stands for, "
                f"or an alias inside itself; {what} holds at most {MAX_YAML_VALUES:,}"
            )
        return None if node is None else loader.construct_document(node)
    except yaml.YAMLError as e:
        raise UserError(f"{path}: not valid YAML: {_yaml_problem(e)}") from None
    except UnicodeDecodeError as e:
        raise UserError(f"{path}: not UTF-8 text (byte {e.start}); {what} must be saved as UTF-8") from None
    except RecursionError:
        raise UserError(f"{path}: nested too deeply to read") from None


def read_config_file(path: Path) -> dict[str, Any]:
    """The sections of a YAML config file as plain values (read_yaml: safe_load's semantics, bounded)."""
    doc = read_yaml(path)
    if doc is not None and not isinstance(doc, dict):
        raise UserError(f"{path}: expected a mapping of sections ({', '.join(SECTIONS)})")
    return doc or {}


def data_section(data: str) -> dict[str, Any]:
    """What ``--data`` names, as a data section, for every command: a source, an image folder
    ``DIR/<class>/<images>`` (the folder source with that root), or a training config .yaml (its data section)."""
    path = Path(data).expanduser()  # as a shell would have, had the ~ not been quoted or after --data=
    if data in SOURCES:
        return {"source": data}
    if (prefixed := source_section(data)) is not None:  # hf:NAME, wds:PATTERN, manifest:FILE
        return prefixed
    if path.is_dir():
        return {"source": "folder", "root": str(path) if data.startswith("~") else data}
    if path.suffix in (".yaml", ".yml") and path.is_file():
        section = read_config_file(path).get("data") or {}
        if not isinstance(section, dict):
            raise UserError(f"{path}: the 'data' section must be a mapping of key: value")
        return dict(section)
    expected = (
        f"expected a source ({', '.join(s for s in SOURCES if s not in FILE_SOURCES)}), an image folder, hf:NAME, "
        "wds:PATTERN, manifest:FILE or a config .yaml file"
    )
    if ("/" in data or data.startswith((".", "~"))) and not path.exists():  # meant as a path: say that first
        what = "no such file" if path.suffix in (".yaml", ".yml") else "no such folder"
        raise UserFileNotFoundError(f"--data {data!r}: {what} ({expected})")
    raise UserError(f"--data {data!r}: {expected}")


def config_purpose(path: Path) -> str:
    """A config file's one-line purpose: the first line of its header comment."""
    for line in path.read_text().splitlines():
        if line.startswith("#"):
            return line.lstrip("#").strip()
        if line.strip():
            break
    return ""


def describe_shipped_configs() -> str:
    """The shipped configs, one a line: name and purpose (each YAML's header comment is the one source)."""
    shipped = sorted(shipped_configs().items())
    width = max(len(name) for name, _ in shipped)
    return "\n".join(f"  {name:<{width}}  {config_purpose(path)}" for name, path in shipped)
