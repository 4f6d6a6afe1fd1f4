"""A large body whose bounded list or mapping (`logit_bias`, `stop_token_ids`: the request model's fields with a
`max_length`) is over its bound is refused from a scan of its bytes, before the JSON parse.

A 100k-entry `logit_bias` is 1.2 MB whose parse builds 200,000 Python objects (tens of milliseconds) only for the
validation to count them and refuse; the scan counts the first bound + 1 items of the field's value with one regular
expression match, after a search of the body for the key and the escapes (1.6 ms for that body, 10 ms for 4.6 MB
of `stop_token_ids`; a body without the key in its first `WALK_BYTES`: microseconds). It runs where large bodies
are parsed (the parser process). It refuses only where the parse would refuse too, so it steps aside (and the
parse decides) whenever it cannot be sure of that:
- the field's quoted name must occur once in the body, in its first `WALK_BYTES`, as a key of the top-level object:
  not inside a string, not in a nested object (a JSON Schema may name a property `logit_bias`), as a walk over
  the strings and brackets before it tells (given up past `WALK_TOKENS` of them);
- no `\\u` escape after it (a later key spelled with one would be the same name, and the last duplicate wins);
- every counted item is a plain scalar (a mapping's keys without escapes): any other value the parse may judge.
It refuses on the bound's items and the start of one more. A mapping's duplicate keys are counted as items: an
object with more members than the bound is refused even if fewer keys are distinct.
"""

from __future__ import annotations

import re
from functools import cache

from annotated_types import MaxLen
from pydantic import BaseModel

from batchserve.entrypoints.openai.errors import APIError

WALK_BYTES = 64 * 1024  # the field's key is looked for this far into the body
WALK_TOKENS = 4096  # strings and brackets walked before it at most: a millisecond or two

# what lies before the next string or bracket, then that token (a string as one token: brackets in it do not count)
_STEP = re.compile(rb'[^"\[\]{}]*("[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}])', re.DOTALL)
_COLON = re.compile(rb"\s*:\s*")
_OBJECT = re.compile(rb"\s*\{")
_SCALAR = rb'[^,\[\]{}"]*'
_NEXT_ITEM = rb"(?=\s*[^\s\]}])"  # then another item begins (not the value's end, nor a trailing comma's)


@cache
def _items(bound: int) -> dict[bytes, re.Pattern[bytes]]:
    """Patterns matching `bound` items, each followed by a comma, and the start of one more, from the value's
    opening bracket."""
    return {
        b"{": re.compile(rb'\{(?:\s*"[^"\\]*"\s*:' + _SCALAR + rb",){%d}" % bound + _NEXT_ITEM),
        b"[": re.compile(rb"\[(?:" + _SCALAR + rb",){%d}" % bound + _NEXT_ITEM),
    }


@cache
def bounded_fields(model: type[BaseModel]) -> tuple[tuple[str, int], ...]:
    """(name in the JSON, bound) of the model's fields with a `max_length`."""
    found = []
    for name, field in model.model_fields.items():
        bound = next((m.max_length for m in field.metadata if isinstance(m, MaxLen)), None)
        if bound is not None:
            found.append((field.alias or name, bound))
    return tuple(found)


def refuse_over_bound(body: bytes, model: type[BaseModel]) -> None:
    """Raise the 400 naming the first bounded field the scan finds over its bound; nothing when it finds none or
    cannot tell."""
    for name, bound in bounded_fields(model):
        if _over_bound(body, name.encode(), bound):
            raise APIError(400, f"{name}: should have at most {bound} items, got more", param=name,
                           code="invalid_value")  # fmt: skip


def _over_bound(body: bytes, name: bytes, bound: int) -> bool:
    key = b'"' + name + b'"'
    at = body.find(key, 0, WALK_BYTES)
    if at < 0 or body.find(key, at + 1) >= 0 or body.find(b"\\u", at) >= 0 or not _top_level_key(body, at):
        return False
    colon = _COLON.match(body, at + len(key))
    if colon is None:
        return False
    pattern = _items(bound).get(body[colon.end() : colon.end() + 1])
    return pattern is not None and pattern.match(body, colon.end()) is not None


def _top_level_key(body: bytes, at: int) -> bool:
    """Whether the string at `at` is a key of the body's top-level object: one bracket deep, outside every string,
    after the object's opening brace or a comma."""
    depth, position = 0, 0
    for _ in range(WALK_TOKENS):
        step = _STEP.match(body, position, at)
        if step is None:
            break
        token, position = step.group(1), step.end()
        if token in b"[{":
            depth += 1
        elif token in b"]}":
            depth -= 1
    else:
        return False  # too long a walk to be sure
    if body.find(b'"', position, at) >= 0:  # a string that does not end before the key: the key is inside it
        return False
    before = body[max(0, at - 64) : at].rstrip()  # whitespace longer than this: not sure, so no
    return depth == 1 and _OBJECT.match(body) is not None and before[-1:] in (b"{", b",")
