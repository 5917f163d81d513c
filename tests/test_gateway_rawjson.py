"""``gateway.rawjson`` against the standard library's ``json`` as the reference.

Whatever bytes come in, ``parse_object`` either declines (None: the gateway then uses
``json.loads``) or returns exactly what ``json.loads`` returns; it declines nothing ordinary (any
object ``json.dumps`` writes, with any spacing, without surrogate escapes). ``RawObject.encode``
writes an object that ``json.loads`` reads back as the fields it was given, in their order,
whichever of them were kept, replaced, removed or added.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvroute.gateway.rawjson import dumps, parse_object

# Text without surrogates (which JSON escapes as \\udXXX, where parse_object declines).
text = st.text(st.characters(exclude_categories=("Cs",)), max_size=12)
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    text,
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(text, inner, max_size=4)),
    max_leaves=12,
)
objects = st.dictionaries(text, values, max_size=6)
styles = st.fixed_dictionaries(
    {
        "ensure_ascii": st.booleans(),
        "indent": st.sampled_from([None, 0, 2, "\t"]),
        "separators": st.sampled_from([None, (",", ":"), (" , ", " : ")]),
    }
)


def no_surrogate_escape(data: bytes) -> bool:
    return not any(
        f"\\u{h}".encode() in data.lower() for h in ("d8", "d9", "da", "db", "dc", "dd", "de", "df")
    )


@settings(max_examples=300, deadline=None)
@given(objects, styles)
def test_objects_parse_as_json_loads_does(obj, style):
    data = json.dumps(obj, **style).encode()
    raw = parse_object(data)
    if no_surrogate_escape(data):
        assert raw is not None
    if raw is not None:
        assert raw.value == json.loads(data)
        assert list(raw.value) == list(json.loads(data))


@settings(max_examples=300, deadline=None)
@given(objects, styles, st.data())
def test_encode_reads_back_as_the_fields_given(obj, style, data):
    raw = parse_object(json.dumps(obj, **style).encode())
    if raw is None:
        return
    fields = {}
    for key, value in raw.value.items():
        fate = data.draw(st.sampled_from(["keep", "replace", "drop"]))
        if fate == "keep":
            fields[key] = value
        elif fate == "replace":
            fields[key] = data.draw(values)
    fields.update(data.draw(st.dictionaries(text, values, max_size=3)))
    out = raw.encode(fields)
    assert json.loads(out) == fields
    assert list(json.loads(out)) == list(fields)


@settings(max_examples=500, deadline=None)
@given(
    st.one_of(
        st.binary(max_size=40),
        st.builds(
            lambda obj, cut, junk: json.dumps(obj).encode()[:cut] + junk,
            objects,
            st.integers(0, 60),
            st.sampled_from([b"", b"}", b",", b" x", b'"', b"\x00", b"\xff", b"]"]),
        ),
    )
)
def test_any_bytes_parse_as_json_loads_does_or_are_declined(data):
    raw = parse_object(data)
    try:
        expected = json.loads(data)
    except (ValueError, RecursionError):
        assert raw is None
        return
    if raw is not None:
        assert raw.value == expected and isinstance(expected, dict)


def test_the_last_of_a_repeated_key_wins_in_the_first_ones_place():
    data = b'{"a": 1, "b": [2], "a": {"c": 3}}'
    raw = parse_object(data)
    assert raw is not None and raw.value == json.loads(data) == {"a": {"c": 3}, "b": [2]}
    assert raw.encode(raw.value) == b'{"a":{"c": 3},"b":[2]}'


def test_kept_values_keep_the_clients_text_and_changed_ones_are_encoded():
    raw = parse_object(b'{"model": "x", "messages": [{"content": "caf\\u00e9"}], "n": 1.50}')
    assert raw is not None
    fields = {**raw.value, "model": "real", "cache_salt": "s"}
    assert raw.encode(fields) == (
        b'{"model":"real","messages":[{"content": "caf\\u00e9"}],"n":1.50,"cache_salt":"s"}'
    )
    # The same value, but another object: encoded (the text is only reused for the very value).
    assert raw.encode({"n": 1.5}) == b'{"n":1.5}'


@pytest.mark.parametrize(
    "data",
    [
        b'{"a": "\\ud800"}',  # a lone surrogate, escaped: declined (json.dumps refuses it later)
        b'{"a": "\\uD83D\\uDE00"}',  # a pair: declined too (json.loads decides)
        b"\xef\xbb\xbf{}",  # a BOM
        '{"a": 1}'.encode("utf-16"),
        b"[1]",
        b"{} x",
        b"",
        b"[" * 100000 + b"]" * 100000,
        b'{"a":' + b"[" * 100000 + b"]" * 100000 + b"}",
    ],
)
def test_declined(data):
    assert parse_object(data) is None


def test_a_raw_lone_surrogate_fails_to_encode_as_json_dumps_does():
    data = b'{"a": "x\xed\xa0\x80y", "b": 1}'
    raw = parse_object(data)
    assert raw is not None and raw.value == json.loads(data)
    with pytest.raises(UnicodeEncodeError):
        raw.encode(raw.value)
    with pytest.raises(UnicodeEncodeError):
        dumps(raw.value).encode()


@given(values)
def test_dumps_is_json_dumps(value):
    assert dumps(value) == json.dumps(value, ensure_ascii=False, separators=(",", ":"))


@given(
    st.recursive(
        st.one_of(st.floats(), scalars),
        lambda inner: st.one_of(
            st.lists(inner, max_size=4), st.dictionaries(text, inner, max_size=4)
        ),
        max_leaves=12,
    )
)
def test_dumps_is_json_dumps_with_non_finite_floats(value):
    """``json.loads`` takes ``NaN`` and ``Infinity`` from a client: they are written back as
    ``json.dumps`` writes them."""
    assert dumps(value) == json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def test_nothing_json_loads_finds_too_deep_is_accepted():
    """json.loads refuses a body nested past the interpreter's recursion budget (the gateway's
    400 nested_too_deeply); parse_object parses the top level itself, so its scanner had one
    level more to spare: a body one level past json.loads's limit was parsed and forwarded.
    Around the limit, parse_object accepts nothing json.loads refuses."""

    def refused(data: bytes) -> bool:
        try:
            json.loads(data)
        except RecursionError:
            return True
        return False

    for depth in range(800, 1200):
        data = b'{"a":' + b"[" * depth + b"]" * depth + b"}"
        if refused(data):
            assert parse_object(data) is None, depth
    ordinary = b'{"a":' + b"[" * 100 + b"]" * 100 + b"}"
    assert parse_object(ordinary) is not None  # a nesting json.loads takes is not declined
