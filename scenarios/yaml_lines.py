"""YAML read with the line of every key and item, for error messages that
point into the file (``schema``).

A custom PyYAML loader builds mappings and sequences as ``YamlMap`` and
``YamlSeq``, which remember the line of every key and item.  Duplicate keys,
which PyYAML would silently overwrite, are recorded for the validator to
report (with the field they belong to).
"""

from __future__ import annotations

import yaml

__all__ = ["YamlMap", "YamlSeq", "empty_map", "located_list", "read_yaml"]


class YamlMap(dict):
    """A mapping that remembers where it, each key and each value start (1-based)."""

    line: int
    key_lines: dict
    text_lines: dict  # where a string value's text starts (a block scalar's next line)
    duplicates: list  # (key, line) of keys seen twice; the last value wins in the dict


class YamlSeq(list):
    """A list that remembers where it, each item and each item's text start (1-based)."""

    line: int
    item_lines: list
    text_lines: list


def _text_line(node: yaml.Node) -> int:
    line = node.start_mark.line + 1
    if isinstance(node, yaml.ScalarNode) and node.style in ("|", ">"):
        line += 1  # the text starts below the indicator
    return line


class _Loader(yaml.SafeLoader):
    pass


def _construct_map(loader: _Loader, node: yaml.MappingNode) -> YamlMap:
    loader.flatten_mapping(node)  # '<<' merge keys
    m = YamlMap()
    m.line, m.key_lines, m.text_lines, m.duplicates = node.start_mark.line + 1, {}, {}, []
    for k, v in node.value:
        key = loader.construct_object(k, deep=True)
        if not isinstance(key, str):
            key = str(key)  # YAML 1.1 reads `no:` as False; the validator reports it as an unknown key
        if key in m:  # keep the first one's lines; the validator reports the second
            m.duplicates.append((key, k.start_mark.line + 1))
        else:
            m.key_lines[key], m.text_lines[key] = k.start_mark.line + 1, _text_line(v)
        m[key] = loader.construct_object(v, deep=True)
    return m


def _construct_seq(loader: _Loader, node: yaml.SequenceNode) -> YamlSeq:
    s = YamlSeq(loader.construct_object(v, deep=True) for v in node.value)
    s.line = node.start_mark.line + 1
    s.item_lines = [v.start_mark.line + 1 for v in node.value]
    s.text_lines = [_text_line(v) for v in node.value]
    return s


_Loader.add_constructor("tag:yaml.org,2002:map", _construct_map)
_Loader.add_constructor("tag:yaml.org,2002:seq", _construct_seq)


def read_yaml(text: str):
    """The document in ``text``, its mappings and sequences ``YamlMap`` and
    ``YamlSeq``. Raises PyYAML's errors (and ``RecursionError``: it composes
    nested nodes recursively)."""
    return yaml.load(text, Loader=_Loader)


def located_list(items: list, line: int) -> YamlSeq:
    """``items`` as a sequence all on ``line`` (a value the validator reads as a list)."""
    s = YamlSeq(items)
    s.line, s.item_lines, s.text_lines = line, [line] * len(items), [line] * len(items)
    return s


def empty_map(line: int) -> YamlMap:
    """An empty mapping at ``line`` (a key given no mapping, read as an empty one)."""
    m = YamlMap()
    m.line, m.key_lines, m.text_lines, m.duplicates = line, {}, {}, []
    return m
