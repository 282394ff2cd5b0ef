"""How the source is cut into modules: no private name crosses a module, no module grows past
600 lines, and the small leaf modules stand on what they claim."""

from __future__ import annotations

import ast
from pathlib import Path

import stalwart
from stalwart import dcp_metadata, loader, safe_load

from .test_catalog import stalwart_imports

SRC = Path(stalwart.__file__).parent
MAX_LINES = 600


def test_no_module_imports_a_private_name_of_another():
    private = [
        (str(path.relative_to(SRC)), module, name)
        for path in sorted(SRC.rglob("*.py"))
        for module, name in stalwart_imports(path)
        if name.startswith("_") and not name.startswith("__")  # __version__ is public
    ]
    assert private == []


def test_no_module_is_over_the_size_limit():
    sizes = {
        str(path.relative_to(SRC)): len(path.read_text(encoding="utf-8").splitlines())
        for path in sorted(SRC.rglob("*.py"))
    }
    assert len(sizes) > 40  # the whole package was read
    assert {name: n for name, n in sizes.items() if n > MAX_LINES} == {}


def test_the_manager_is_thin():
    # 550 until rollback(), which only delegates (stalwart.rollback.rollback_run).
    assert len((SRC / "manager.py").read_text(encoding="utf-8").splitlines()) <= 560


def test_the_loader_stands_on_the_sampler_never_the_reverse():
    assert "stalwart.sampler" in {module for module, _ in stalwart_imports(SRC / "loader.py")}
    assert not [m for m, _ in stalwart_imports(SRC / "sampler.py") if m == "stalwart.loader"]


def test_redaction_is_plain_data():
    tree = ast.parse((SRC / "redact.py").read_text(encoding="utf-8"))
    imported = {
        alias.name for n in ast.walk(tree) if isinstance(n, ast.Import) for alias in n.names
    }
    imported |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    heavy = {m for m in imported if m.split(".")[0] in {"stalwart", "torch", "obstore", "fsspec"}}
    assert heavy == set()


def test_moved_names_stay_importable_where_they_were_public():
    assert safe_load.read_dcp_metadata is dcp_metadata.read_dcp_metadata
    assert "read_dcp_metadata" in safe_load.__all__
    assert stalwart.ResumableDataLoader is loader.ResumableDataLoader


def test_nothing_below_imports_the_integrations():
    importers = [
        str(path.relative_to(SRC))
        for path in sorted(SRC.rglob("*.py"))
        if "integrations" not in path.parts
        for module, name in stalwart_imports(path)
        if module.startswith("stalwart.integrations")
        or (module, name) == ("stalwart", "integrations")
    ]
    assert importers == []
