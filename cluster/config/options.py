"""An engine option declared once: its default, its bounds or allowed values, and what it means.

A sub-config declares each option it takes from users with `option(...)`; the same declaration
gives the deploy file its typed field (actors/engine_args.py derives EngineArgs from it) and the
sub-config its check (`check_options`, run by `EngineConfig.finalize`), so a bound or an allowed
value is written in one place. `Freezable` makes the resolved copy `finalize` returns read-only.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Bounds:
    """What values an option takes: numeric bounds and / or allowed values; `nullable`: None too."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    choices: tuple[Any, ...] | None = None
    nullable: bool = False
    boolean: bool = False  # true or false, nothing else
    doc: str = ""

    def problem(self, value: Any) -> str | None:
        """Why `value` is refused, or None."""
        if value is None:
            return None if self.nullable else "may not be null"
        if self.boolean:
            return None if isinstance(value, bool) else "must be true or false"
        if self.choices is not None and value not in self.choices:
            return f"must be one of {self.choices}{' or null' if self.nullable else ''}"
        numeric = (self.ge, self.gt, self.le) != (None, None, None)
        if numeric and (isinstance(value, bool) or not isinstance(value, (int, float))):
            return "must be a number"
        if self.ge is not None and value < self.ge:
            return f"must be at least {_num(self.ge)}"
        if self.gt is not None and value <= self.gt:
            return f"must be greater than {_num(self.gt)}{' (or null for none)' if self.nullable else ''}"
        if self.le is not None and value > self.le:
            return f"must be at most {_num(self.le)}"
        return None


def option(default: Any = None, *, doc: str = "", **bounds: Any) -> Any:
    """A user-settable field of a sub-config (a dataclass field carrying its `Bounds`)."""
    return dataclasses.field(default=default, metadata={"option": Bounds(doc=doc, **bounds)})


def options(cls_or_obj: Any) -> dict[str, Bounds]:
    """The option fields of a sub-config class or instance, by name."""
    return {f.name: f.metadata["option"] for f in dataclasses.fields(cls_or_obj) if "option" in f.metadata}


def check_options(obj: Any, prefix: str = "") -> None:
    """ValueError naming the first option of `obj` whose value its Bounds refuse."""
    for name, bounds in options(obj).items():
        value = getattr(obj, name)
        problem = bounds.problem(value)
        if problem is not None:
            raise ValueError(f"{prefix}{name} {problem}, got {value!r}")


class FrozenDict(dict):
    """A dict that refuses changes: what a resolved config holds where its options held a dict.
    Pickles and deep-copies as itself (a config travels to Ray actors pickled)."""

    def _refuse(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("a resolved config is frozen: its mappings cannot change; set the option before "
                        "EngineConfig.finalize()")

    __setitem__ = __delitem__ = __ior__ = clear = pop = popitem = setdefault = update = _refuse

    def __reduce__(self) -> tuple:
        return FrozenDict, (dict(self),)


def readonly(value: Any) -> Any:
    """`value` with every list turned into a tuple and every dict into a FrozenDict, nested ones too."""
    if isinstance(value, (list, tuple)):
        return tuple(readonly(v) for v in value)
    if isinstance(value, dict) and not isinstance(value, FrozenDict):
        return FrozenDict({k: readonly(v) for k, v in value.items()})
    return value


class Freezable:
    """A mutable dataclass while it holds options; read-only once `_freeze` ran (resolution
    freezes the copy it returns). Assigning or deleting an attribute of a frozen one raises
    `dataclasses.FrozenInstanceError` naming it; its lists become tuples and its dicts
    FrozenDicts, so their contents cannot change either. The flag lives in the instance's `__dict__`, so
    pickle and `copy.deepcopy` (which restore `__dict__` without `__setattr__`) keep it;
    `dataclasses.replace` builds a new, unfrozen object."""

    @property
    def is_resolved(self) -> bool:
        """True for the frozen copy resolution returned (and its pickles and deep copies)."""
        return self.__dict__.get("_frozen", False)

    def _freeze(self) -> None:
        for f in dataclasses.fields(self):
            object.__setattr__(self, f.name, readonly(getattr(self, f.name)))
        object.__setattr__(self, "_frozen", True)

    def __setattr__(self, name: str, value: Any) -> None:
        self._refuse_if_frozen(name)
        super().__setattr__(name, value)

    def __delattr__(self, name: str) -> None:
        self._refuse_if_frozen(name)
        super().__delattr__(name)

    def _refuse_if_frozen(self, name: str) -> None:
        if self.__dict__.get("_frozen", False):
            raise dataclasses.FrozenInstanceError(
                f"cannot assign to {type(self).__name__}.{name}: a resolved config is frozen; set the option "
                "before EngineConfig.finalize() (or build new options and resolve them)")


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)
