"""Every Python file of the project reads only names it defines, imports or Python provides.

The benchmarks run only when someone runs them, so a lost import there (real_size_files.py's `os`
from 2026-11-30 to 2026-12-07) surfaced only on a machine without its cached files. Python's own
symbol tables say which names each scope reads from the module's globals; each must be bound at
module level (assigned, imported, defined, or declared `global` and assigned in a function) or be
a builtin."""
from __future__ import annotations

import builtins
import symtable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("cluster", "actors", "benchmarks", "tests")
MODULE_ATTRS = {"__file__", "__name__", "__doc__", "__spec__", "__loader__", "__package__", "__path__",
                "__builtins__", "__annotations__", "__dict__"}


def _scopes(table: symtable.SymbolTable):
    yield table
    for child in table.get_children():
        yield from _scopes(child)


def unbound_globals(source: str, filename: str) -> set[str]:
    """The names some scope of `source` reads as globals that nothing binds."""
    top = symtable.symtable(source, filename, "exec")
    bound = {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported()}
    read = set()
    for scope in _scopes(top):
        for sym in scope.get_symbols():
            if sym.is_declared_global() and sym.is_assigned():
                bound.add(sym.get_name())
            elif sym.is_referenced() and (scope is top or sym.is_global()):
                read.add(sym.get_name())
    return read - bound - set(dir(builtins)) - MODULE_ATTRS


def test_a_lost_import_is_found():
    src = "import json\n\ndef f():\n    return [os.getpid() for _ in json.loads('[1]')]\n"
    assert unbound_globals(src, "example.py") == {"os"}
    assert unbound_globals("import os\n" + src, "example.py") == set()


@pytest.mark.parametrize("folder", FOLDERS)
def test_every_file_binds_what_it_reads(folder):
    files = sorted((ROOT / folder).rglob("*.py"))
    assert files, folder
    unbound = {}
    for path in files:
        names = unbound_globals(path.read_text(), str(path))
        if names:
            unbound[str(path.relative_to(ROOT))] = sorted(names)
    assert unbound == {}
