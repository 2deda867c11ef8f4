"""Reading a YAML or JSON document from a file a careless user or an attacker may have written, in bounded
time and memory: the size, the nesting depth and the number of values (YAML aliases expanded) are checked
against :mod:`adaptdist.limits` before the document is built or walked, duplicate mapping keys (which YAML
would silently resolve to the last one) are refused, and every failure is the caller's own typed error
naming the file.

    doc = load_yaml_file(path, "cluster file", ClusterSpecError, loader=MyLoader)
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import yaml

from . import limits


class NoDuplicateKeys:
    """A yaml Loader mixin refusing a mapping that writes one key twice (``rank: 0`` ... ``rank: 1``); a key
    given by a merge (``<<: *base``) and written again overrides it, as YAML means."""

    def construct_mapping(self, node, deep=False):  # noqa: D102 - yaml's hook
        if isinstance(node, yaml.MappingNode):
            seen: dict[tuple[str, str], Any] = {}
            for key_node, _ in node.value:
                if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                k = (key_node.tag, key_node.value)
                if k in seen:
                    raise yaml.constructor.ConstructorError(
                        "while constructing a mapping", node.start_mark,
                        f"found the key {key_node.value!r} twice (first {seen[k]}); keep one", key_node.start_mark)
                seen[k] = f"line {key_node.start_mark.line + 1}"
        return super().construct_mapping(node, deep)  # type: ignore[misc]


class SafeLoader(NoDuplicateKeys, getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # type: ignore[misc]
    """yaml's safe loader (libyaml's when built) refusing duplicate keys."""


def read_text(path: str | os.PathLike, what: str, error: type[Exception]) -> str:
    """The text of ``path`` (``what`` names it in errors, e.g. ``cluster file``), refusing a missing file, one
    over :data:`~adaptdist.limits.MAX_FILE_BYTES` (checked before reading) and one that is not UTF-8.

    Raises:
        error: the message names the file and what is wrong.
    """
    p = Path(path)
    if not p.is_file():
        raise error(f"{what} {str(p)!r} does not exist" + ("" if not p.exists() else " as a regular file"))
    size = p.stat().st_size
    if size > limits.MAX_FILE_BYTES:
        raise error(f"{what} {str(p)!r} is {size / 2**20:,.1f} MiB, over the limit of "
                    f"{limits.MAX_FILE_BYTES / 2**20:.0f} MiB for such a file; is it the right file?")
    try:
        return p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{what} {str(p)!r} is not UTF-8 text: {e}") from None
    except OSError as e:
        raise error(f"{what} {str(p)!r} cannot be read: {e.strerror or e}") from None


def _yaml_depth(text: str, loader: type) -> int:
    """The deepest nesting of ``text``'s mappings and lists, from the parser's events (no recursion, no
    document built); stops counting past :data:`~adaptdist.limits.MAX_DEPTH`."""
    depth = deepest = 0
    for ev in yaml.parse(text, Loader=loader):
        if isinstance(ev, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            depth += 1
            deepest = max(deepest, depth)
            if depth > limits.MAX_DEPTH:
                break
        elif isinstance(ev, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
            depth -= 1
    return deepest


def measure(doc: object) -> tuple[int, int]:
    """``(values, depth)`` of a parsed document, every alias counted as what it expands to; iterative (no
    recursion), each distinct list or mapping visited once.

    Raises:
        ValueError: the document contains itself (a YAML alias to an enclosing node).
    """
    sizes: dict[int, tuple[int, int]] = {}
    open_: set[int] = set()
    stack: list[tuple[Any, bool]] = [(doc, False)]
    while stack:
        obj, done = stack.pop()
        if not isinstance(obj, (dict, list)):
            continue
        i = id(obj)
        children = [*obj.keys(), *obj.values()] if isinstance(obj, dict) else obj
        if done:
            n, d = 1, 1
            for c in children:
                cn, cd = sizes.get(id(c), (1, 0)) if isinstance(c, (dict, list)) else (1, 0)
                n, d = n + cn, max(d, 1 + cd)
            sizes[i] = (n, d)
            open_.discard(i)
            continue
        if i in sizes:
            continue
        if i in open_:
            raise ValueError("the document refers to itself (a YAML alias to a mapping or list that encloses it)")
        open_.add(i)
        stack.append((obj, True))
        stack.extend((c, False) for c in children if isinstance(c, (dict, list)))
    return sizes.get(id(doc), (1, 0))


def check_shape(doc: object, source: str, error: type[Exception]) -> object:
    """Refuse a document deeper than :data:`~adaptdist.limits.MAX_DEPTH` or with more than
    :data:`~adaptdist.limits.MAX_NODES` values (aliases expanded), or one that contains itself; returns it.

    Raises:
        error: names ``source`` and the limit.
    """
    try:
        nodes, depth = measure(doc)
    except ValueError as e:
        raise error(f"{source}: {e}; write the entries out") from None
    if depth > limits.MAX_DEPTH:
        raise error(f"{source} nests {depth} levels deep, over the limit of {limits.MAX_DEPTH}; is it the right file?")
    if nodes > limits.MAX_NODES:
        raise error(f"{source} holds {nodes:,} values (YAML aliases expanded), over the limit of "
                    f"{limits.MAX_NODES:,}; is it the right file?")
    return doc


def load_yaml_text(text: str, source: str, error: type[Exception], loader: type = SafeLoader) -> object:
    """Parse YAML ``text`` (``source`` names it in errors, e.g. ``cluster file 'c.yaml'``) with ``loader`` (a safe
    loader; :class:`SafeLoader` by default), bounded as the module docstring says.

    Raises:
        error: not YAML, a duplicate key, too deep, too many values, or self-referring.
    """
    try:
        if _yaml_depth(text, loader) > limits.MAX_DEPTH:
            raise error(f"{source} nests more than {limits.MAX_DEPTH} levels deep, over the limit; is it the right "
                        "file?")
        doc = yaml.load(text, Loader=loader)  # noqa: S506 - a safe loader
    except yaml.YAMLError as e:
        raise error(f"{source} is not valid YAML: {e}") from None
    except RecursionError:
        raise error(f"{source} nests too deeply to read (limit {limits.MAX_DEPTH} levels)") from None
    return check_shape(doc, source, error)


def load_json_text(text: str, source: str, error: type[Exception]) -> object:
    """Parse JSON ``text`` bounded as :func:`load_yaml_text` (``NaN``/``Infinity`` are refused: not JSON).

    Raises:
        error: not JSON, too deep, too many values.
    """
    def no_constant(name: str) -> float:
        raise ValueError(f"{name} is not a JSON number")

    try:
        doc = json.loads(text, parse_constant=no_constant)
    except (json.JSONDecodeError, ValueError) as e:
        raise error(f"{source} is not valid JSON: {e}") from None
    except RecursionError:
        raise error(f"{source} nests too deeply to read (limit {limits.MAX_DEPTH} levels)") from None
    return check_shape(doc, source, error)


def load_yaml_file(path: str | os.PathLike, what: str, error: type[Exception], loader: type = SafeLoader) -> object:
    """:func:`read_text` then :func:`load_yaml_text`; ``what`` as ``"cluster file"``."""
    text = read_text(path, what, error)
    return load_yaml_text(text, f"{what} {str(path)!r}", error, loader)


def load_json_file(path: str | os.PathLike, what: str, error: type[Exception]) -> object:
    """:func:`read_text` then :func:`load_json_text`."""
    text = read_text(path, what, error)
    return load_json_text(text, f"{what} {str(path)!r}", error)
