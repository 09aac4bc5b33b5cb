"""JSON Schema `$ref` resolution as llguidance's JSON compiler does it (RFC 3986, section 5).

llguidance 1.9.1 resolves a reference against the base URI of the schema it sits in: the
nearest enclosing `$id` (itself resolved against its parent's base), else `json-schema:///`.
So `#/$defs/a`, `json-schema:///#/$defs/a`, `JSON-SCHEMA:///./#/$defs/a`, `/#/$defs/a`,
`x/..#/$defs/a` and `%2e/#/$defs/a` all name the same schema, while `json-schema:/#/...`,
`json-schema://#/...` and `?#/...` name documents it does not have (checked against the library:
tests/unit/engine_common/constraints/test_constraint_depth.py). `resolve` gives a reference's document as a
`DocumentUri` (comparable: scheme and host lower-cased, dot segments removed) and its raw
fragment.
"""
from __future__ import annotations

import re
from typing import NamedTuple

# RFC 3986, appendix B: scheme, authority, path, query, fragment; None where absent.
_PARTS = re.compile(r"^(?:([^:/?#]+):)?(?://([^/?#]*))?([^?#]*)(?:\?([^#]*))?(?:#(.*))?$",
                    re.DOTALL)
_DOT = re.compile(r"%2e", re.IGNORECASE)


class DocumentUri(NamedTuple):
    scheme: str
    authority: str | None
    path: str
    query: str | None


DEFAULT_BASE = DocumentUri("json-schema", "", "/", None)


def resolve(base: DocumentUri, reference: str) -> tuple[DocumentUri, str | None]:
    """(the document `reference` names, its fragment or None) against `base`."""
    scheme, authority, path, query, fragment = _PARTS.match(reference).groups()
    path = _DOT.sub(".", path)
    if scheme is not None:
        target = DocumentUri(scheme.lower(), _host(authority), _remove_dots(path), query)
    elif authority is not None:
        target = DocumentUri(base.scheme, _host(authority), _remove_dots(path), query)
    elif not path:
        target = base._replace(query=query if query is not None else base.query)
    elif path.startswith("/"):
        target = base._replace(path=_remove_dots(path), query=query)
    else:
        target = base._replace(path=_remove_dots(_merge(base, path)), query=query)
    return target, fragment


def _host(authority: str | None) -> str | None:
    return None if authority is None else authority.lower()


def _merge(base: DocumentUri, path: str) -> str:
    """RFC 3986 5.2.3: a relative path against the base's directory."""
    if base.authority is not None and not base.path:
        return "/" + path
    return base.path[:base.path.rfind("/") + 1] + path


def _remove_dots(path: str) -> str:
    """RFC 3986 5.2.4, on whole segments."""
    absolute = path.startswith("/")
    segments = path.split("/")[1:] if absolute else path.split("/")
    out: list[str] = []
    for i, segment in enumerate(segments):
        last = i == len(segments) - 1
        if segment == ".":
            if last:
                out.append("")
        elif segment == "..":
            if out:
                out.pop()
            if last:
                out.append("")
        else:
            out.append(segment)
    return ("/" if absolute else "") + "/".join(out)
