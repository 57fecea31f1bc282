"""A setting's help is its docstring: the string literal under the field in its class."""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """{field name: its docstring, whitespace collapsed} for the fields `cls` itself declares."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, after in zip(body, body[1:], strict=False):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def title(cls: type) -> str:
    """A component's heading: the first line of its class docstring."""
    return (cls.__doc__ or cls.__name__).strip().splitlines()[0].rstrip(".")
