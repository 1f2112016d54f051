"""The layer rule, checked by import-linter: base < privacy < server | client < audits < app.

Prepare / Execute / Assert: the contract in ``pyproject.toml`` is run on the real tree (kept)
and on a scratch copy with one wrong import added (broken, naming the import).
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("fl_secure", "privacy", "server", "client", "audits")


def _lint_imports(cwd: Path) -> subprocess.CompletedProcess[str]:
    exe = Path(sys.executable).with_name("lint-imports")
    if not exe.exists():
        pytest.fail(f"import-linter is not installed next to {sys.executable}: make venv")
    env = {**os.environ, "PYTHONPATH": str(cwd)}
    return subprocess.run(
        [str(exe), "--no-cache"], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


def _layers() -> list[str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    (contract,) = config["tool"]["importlinter"]["contracts"]
    layers: list[str] = contract["layers"]
    return layers


def test_layer_contract_holds_on_the_tree() -> None:
    done = _lint_imports(ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 kept, 0 broken" in done.stdout


def test_base_layer_names_every_module_of_fl_secure_but_the_app_layer() -> None:
    # Prepare: what fl_secure holds on disk
    on_disk = {
        p.stem if p.suffix == ".py" else p.name
        for p in (ROOT / "fl_secure").iterdir()
        if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").exists()
    }
    # Execute: what the lowest layer names
    base = {name.strip().removeprefix("fl_secure.") for name in _layers()[-1].split(":")}
    # Assert: every module but app is in the base, so none escapes the contract
    assert on_disk - {"app"} == base
    assert _layers()[0] == "fl_secure.app"


@pytest.mark.parametrize(
    ("module", "wrong"),
    [
        ("fl_secure/data/types.py", "import server.summary"),  # base -> server
        ("privacy/dp/noise.py", "import client.trainer"),  # privacy -> client
        ("server/summary.py", "import client.trainer"),  # server <-> client
        ("audits/grids.py", "import fl_secure.app.cli"),  # audits -> app
    ],
)
def test_a_wrong_import_breaks_the_contract(tmp_path: Path, module: str, wrong: str) -> None:
    # Prepare: a scratch copy of the packages with one import that points up (or across)
    for package in PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("*.pyc"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    target = tmp_path / module
    source = target.read_text()
    marker = "from __future__ import annotations\n"
    assert marker in source
    target.write_text(source.replace(marker, f"{marker}\n{wrong}  # noqa: F401\n", 1))
    # Execute
    done = _lint_imports(tmp_path)
    # Assert: broken, and the report names the offending import
    assert done.returncode != 0
    assert "1 broken" in done.stdout
    importer = module.removesuffix(".py").replace("/", ".")
    assert f"{importer} -> {wrong.removeprefix('import ')}" in done.stdout


def _sources() -> list[Path]:
    return [
        path
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
        if "v1" not in path.relative_to(ROOT).parts
    ]


def _first_party_imports_in_functions(path: Path) -> list[int]:
    """Line numbers of first-party imports inside a function, outside ``if TYPE_CHECKING:``."""
    tree = ast.parse(path.read_text())
    found: list[int] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.dump(child.test):
                continue
            if in_function and isinstance(child, ast.Import | ast.ImportFrom):
                names = (
                    [a.name for a in child.names]
                    if isinstance(child, ast.Import)
                    else [child.module or ""]
                )
                if any(n.split(".")[0] in PACKAGES for n in names) and not getattr(
                    child, "level", 0
                ):
                    found.append(child.lineno)
            function = isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef)
            visit(child, in_function or function)

    visit(tree, False)
    return found


def test_imports_inside_functions_say_why() -> None:
    # The CLI defers whole layers so that `fl-secure --help` imports no torch (the package
    # docstring says so; tests/fl_secure/app/cli/test_console.py checks it). Anywhere else a
    # first-party import inside a function needs a comment just above saying why.
    cli = ROOT / "fl_secure" / "app" / "cli"
    unexplained = []
    for path in _sources():
        if cli in path.parents:
            continue
        lines = path.read_text().splitlines()
        for number in _first_party_imports_in_functions(path):
            above = " ".join(lines[max(0, number - 6) : number - 1]).lower()
            if not any(word in above for word in ("deferred", "cycle", "looked up")):
                unexplained.append(f"{path.relative_to(ROOT)}:{number}")
    assert unexplained == []


def test_modules_past_500_lines_state_why() -> None:
    # STYLE.md: files of one concept, mostly 100-400 lines; past ~500, say why at the top
    unexplained = []
    for path in _sources():
        text = path.read_text()
        if text.count("\n") > 500:
            head = (ast.get_docstring(ast.parse(text)) or "").lower()
            if "lines" not in head:
                unexplained.append(f"{path.relative_to(ROOT)}: {text.count(chr(10))} lines")
    assert unexplained == []


def test_privacy_figures_are_rounded_in_one_place() -> None:
    # an epsilon rounded with its own ceil/floor and tolerance drifts from the others
    rounding = ROOT / "privacy" / "dp" / "rounding.py"
    copies = [
        f"{path.relative_to(ROOT)}:{n}"
        for path in _sources()
        if path != rounding
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"math\.(ceil|floor)\(.*[-+] 1e-\d", line)
    ]
    assert copies == []
