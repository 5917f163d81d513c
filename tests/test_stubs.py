"""``kvroute/_core.pyi`` against the extension module itself: the same public names, and for every
class the same methods and properties, with the same parameters (names, kinds, defaults).

Stub-only helpers (``typing.type_check_only`` classes such as the hashers' shared base, and type
aliases) must not exist at run time; members a class inherits from them count as its own. Members
inherited from a builtin base (an exception's ``args``) need not be repeated.

A constructor whose keywords default to None at run time (the core applies its own default) may
show the resolved value in the stub; the class then exposes ``config``, and the stub's values are
checked against the ``config`` of an object built without them."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import kvroute
import pytest
from kvroute import _core

STUB = ast.parse((Path(kvroute.__file__).parent / "_core.pyi").read_text())
CLASSES = {n.name: n for n in STUB.body if isinstance(n, ast.ClassDef)}
FUNCTIONS = {n.name: n for n in STUB.body if isinstance(n, ast.FunctionDef)}


def stub_only(cls: ast.ClassDef) -> bool:
    return any(getattr(d, "id", None) == "type_check_only" for d in cls.decorator_list)


PUBLIC_CLASSES = sorted(name for name, cls in CLASSES.items() if not stub_only(cls))


def members(cls: ast.ClassDef) -> dict[str, ast.FunctionDef]:
    """The functions of a stub class, with those of its stub-defined bases (overridable)."""
    found: dict[str, ast.FunctionDef] = {}
    for base in cls.bases:
        if isinstance(base, ast.Name) and base.id in CLASSES:
            found.update(members(CLASSES[base.id]))
    for node in cls.body:
        if isinstance(node, ast.FunctionDef):
            found[node.name] = node  # an @overload group keeps its last signature
    return found


def stub_only_base(base: ast.expr) -> bool:
    return isinstance(base, ast.Name) and base.id in CLASSES and stub_only(CLASSES[base.id])


def is_property(func: ast.FunctionDef) -> bool:
    return any(getattr(d, "id", None) == "property" for d in func.decorator_list)


def stub_params(func: ast.FunctionDef, skip_first: bool) -> list[tuple[str, str, object]]:
    """``(name, kind, default)`` of the stub's parameters; default is ``inspect._empty`` or a
    literal value."""
    a = func.args
    positional = [(p, "POSITIONAL_ONLY") for p in a.posonlyargs]
    positional += [(p, "POSITIONAL_OR_KEYWORD") for p in a.args]
    defaults = [inspect.Parameter.empty] * (len(positional) - len(a.defaults))
    defaults += [ast.literal_eval(d) for d in a.defaults]
    out = [(p.arg, kind, d) for (p, kind), d in zip(positional, defaults, strict=True)]
    if skip_first:
        out = out[1:]
    for p, d in zip(a.kwonlyargs, a.kw_defaults, strict=True):
        default = inspect.Parameter.empty if d is None else ast.literal_eval(d)
        out.append((p.arg, "KEYWORD_ONLY", default))
    return out


def runtime_params(obj: object) -> list[tuple[str, str, object]]:
    """The same for a runtime callable (from its ``__text_signature__``), without ``self``."""
    params = inspect.signature(obj).parameters.values()
    return [(p.name, p.kind.name, p.default) for p in params if p.name != "self"]


def test_module_names_match():
    runtime = {n for n in dir(_core) if not n.startswith("_")}
    assert set(PUBLIC_CLASSES) | set(FUNCTIONS) == runtime
    for name, cls in CLASSES.items():
        if stub_only(cls):
            assert not hasattr(_core, name), f"{name} is marked stub-only but exists"
    assert set(kvroute.__all__) >= set(PUBLIC_CLASSES) | set(FUNCTIONS)
    (exported,) = [
        ast.literal_eval(n.value)
        for n in STUB.body
        if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", None) == "__all__"
    ]
    assert sorted(exported) == sorted(_core.__all__)
    # Module-level names the stub declares for users are real; its type aliases are private.
    declared = {
        t.id
        for n in STUB.body
        if isinstance(n, (ast.Assign, ast.AnnAssign))
        for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
    }
    assert {d for d in declared if not d.startswith("_")} <= set(dir(_core))


@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_function_signatures(name):
    got = runtime_params(getattr(_core, name))
    want = stub_params(FUNCTIONS[name], skip_first=False)
    assert want == got


def builtin_members(cls: type) -> set[str]:
    """Names ``cls`` inherits from builtin bases (``object``, ``ValueError`` …)."""
    return {n for base in cls.__mro__[1:] if base.__module__ == "builtins" for n in dir(base)}


def resolved_defaults(
    want: list[tuple[str, str, object]], got: list[tuple[str, str, object]]
) -> list[tuple[str, str, object]]:
    """``want`` with each default the runtime leaves to the core (None) replaced by None."""
    return [
        (n, k, None if g[2] is None and d is not inspect.Parameter.empty else d)
        for (n, k, d), g in zip(want, got, strict=False)  # lengths are compared after
    ]


@pytest.mark.parametrize("name", PUBLIC_CLASSES)
def test_class_members_and_signatures(name):
    runtime_cls = getattr(_core, name)
    stubbed = members(CLASSES[name])
    final = any(getattr(d, "id", None) == "final" for d in CLASSES[name].decorator_list)
    subclassable = bool(runtime_cls.__flags__ & (1 << 10))  # Py_TPFLAGS_BASETYPE
    assert final != subclassable
    bases = [b.__name__ for b in runtime_cls.__bases__ if b is not object]
    assert [getattr(b, "id", None) for b in CLASSES[name].bases if not stub_only_base(b)] == bases
    public = {n for n in stubbed if not n.startswith("_")}
    inherited = builtin_members(runtime_cls)
    assert public == {n for n in dir(runtime_cls) if not n.startswith("_") and n not in inherited}
    protocols = {"__len__", "__contains__", "__iter__", "__getitem__", "__call__"}
    assert protocols & set(vars(runtime_cls)) <= set(stubbed)
    for member, func in stubbed.items():
        if member in ("__init__", "__new__"):
            want = stub_params(func, skip_first=True)
            got = runtime_params(runtime_cls)
            if "config" in stubbed:  # defaults resolved by the core: see test_stub_defaults_*
                want = resolved_defaults(want, got)
            assert want == got, member
            continue
        assert hasattr(runtime_cls, member), member
        if member.startswith("__"):
            continue  # a slot (len(), in): called by the operator, its parameter names unused
        attr = inspect.getattr_static(runtime_cls, member)
        if is_property(func):
            assert inspect.isgetsetdescriptor(attr), member
            continue
        static = any(getattr(d, "id", None) == "staticmethod" for d in func.decorator_list)
        assert static == isinstance(attr, staticmethod), member
        want = stub_params(func, skip_first=not static)
        got = runtime_params(getattr(runtime_cls, member))
        assert want == got, member


def test_stub_defaults_are_the_routers_effective_config():
    """The defaults the stub shows are the ones a Router built without them uses, and passing
    None for a keyword is the same as leaving it out."""
    params = stub_params(members(CLASSES["Router"])["__new__"], skip_first=True)
    shown = {n: d for n, kind, d in params if kind == "KEYWORD_ONLY"}
    # `roles` is per worker, like `workers`: shown by `router.roles`, not by `config`.
    assert shown.pop("roles") is None
    assert kvroute.Router(["a"]).roles == {"a": "both"}
    assert kvroute.Router(["a"]).config == shown
    assert kvroute.Router(["a"], **dict.fromkeys(shown)).config == shown
    # Every keyword is in `config`, and a value given is the value in effect.
    given = {
        "policy": "hash",
        "block_size": 8,
        "hash_profile": "vllm",
        "index": "events",
        "capacity_blocks": 100,
        "ttl": 3.0,
        "queue_weight": 0.25,
        "decode_weight": 0.0,
        "load_bound": 2.0,
        "seed": 9,
        "stale_half_life": 1.5,
        "tier_weights": {"DISK": 0.1},
        "salt": "s",
        "hash_seed": "0",
        "event_mode": "direct",
        "hash_algo": "sha256",
        "vllm_version": "0.31",
        "updates": False,  # True needs index="approx": checked below
        "pd_threshold": 100,
        "pd_saturation": 2.5,
        "pd_local_prefill": False,
    }
    assert set(given) == set(shown)
    assert kvroute.Router(["a"], **given).config == given
    assert kvroute.Router(["a"], updates=True).config["updates"] is True
