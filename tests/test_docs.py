"""The commands shown in README.md and docs/ are current (scripts/check_docs.py).

Prepare / Execute / Assert: the checker runs over the real repository (no stale command), over
a scratch page of deliberately stale commands (each one named by file and line), and over a
scratch project whose console script points at another module (the parser is found through
pyproject.toml, not a fixed path).
"""

from __future__ import annotations

import importlib.util
import sys
import uuid
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load_checker() -> ModuleType:
    spec = importlib.util.spec_from_file_location("check_docs", ROOT / "scripts" / "check_docs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("check_docs", module)
    spec.loader.exec_module(module)
    return module


check_docs = _load_checker()


def test_no_stale_command_in_readme_or_docs() -> None:
    commands, problems = check_docs.check_repository(ROOT)

    assert len(commands) > 50, "the README and docs show commands; none were found"
    assert any(c.path.name == "README.md" for c in commands)
    assert [p.render(ROOT) for p in problems] == []


STALE_PAGE = """\
# Stale

```bash
fl-secure trian --config examples/quickstart.toml
fl-secure train --config examples/quickstart.toml --no-such-flag
fl-secure train --config examples/no-such-config.toml
make no-such-target
python benchmarks/learning.py --no-such-flag
fl-secure privacy epsilon --noise-multiplier 1 --sample-rate 0.1 --steps 5 \\
    --delta 1e-5 --accountant {rdp,nope}
```

Placeholders and real commands pass:

```console
$ fl-secure audit --run RUN_DIR --targets N --attack inversion
$ fl-secure train --config examples/{quickstart,orl}.toml --set train.rounds=3
$ make demo && python benchmarks/learning.py --config examples/quickstart.toml
$ fl-secure client ... --state-dir ./state [--delta 1e-5] [--assume-colluding-peers]
```

Inline, over a line break: `fl-secure report --run DIR
--no-such-format`.
"""


def test_stale_commands_are_reported_with_file_and_line(tmp_path: Path) -> None:
    page = tmp_path / "stale.md"
    page.write_text(STALE_PAGE)

    commands, problems = check_docs.check_files([page], ROOT)
    found = {(p.line, p.message) for p in problems}
    rendered = [p.render(ROOT) for p in problems]

    assert len(commands) == 11
    assert {line for line, _ in found} == {4, 5, 6, 7, 8, 9, 22}
    assert any(line == 4 and "no sub-command 'trian'" in m for line, m in found)
    assert any(
        line == 5 and "fl-secure train has no option --no-such-flag" in m for line, m in found
    )
    assert any(line == 6 and "no file examples/no-such-config.toml" in m for line, m in found)
    assert any(line == 7 and "no target 'no-such-target'" in m for line, m in found)
    assert any(line == 8 and "learning.py has no option --no-such-flag" in m for line, m in found)
    assert any(line == 9 and "'nope' is not one of" in m for line, m in found)
    assert any(line == 22 and "report has no option --no-such-format" in m for line, m in found)
    assert all(r.startswith(f"{page}:") for r in rendered)


def test_main_exits_non_zero_naming_the_stale_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    page = tmp_path / "page.md"
    page.write_text("```sh\nmake demo\nmake no-such-target\n```\n")

    code = check_docs.main(["--root", str(ROOT), str(page)])
    out = capsys.readouterr().out

    assert code == 1
    assert f"{page}:3: the Makefile has no target 'no-such-target'" in out
    assert "1 stale" in out


def _scratch_project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str) -> Path:
    module = f"scratch_cli_{uuid.uuid4().hex}"
    (tmp_path / f"{module}.py").write_text(source)
    (tmp_path / "pyproject.toml").write_text(
        f'[project]\nname = "x"\n[project.scripts]\nfl-secure = "{module}:run"\n'
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


PARSER_SOURCE = """\
import argparse

def run(argv=None):
    return odd_name().parse_args(argv)

def odd_name() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fl-secure")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("go").add_argument("--fast", action="store_true")
    return p
"""

MAIN_ONLY_SOURCE = """\
import argparse

def run(argv=None):
    p = argparse.ArgumentParser(prog="fl-secure")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("go").add_argument("--fast", action="store_true")
    return p.parse_args(argv)
"""


@pytest.mark.parametrize("source", [PARSER_SOURCE, MAIN_ONLY_SOURCE], ids=["builder", "main"])
def test_parser_is_found_through_the_console_script(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str
) -> None:
    root = _scratch_project(tmp_path, monkeypatch, source)

    cli = check_docs.load_cli(root)

    assert isinstance(cli, check_docs.CLIChecker)
    assert cli.check(["go", "--fast"]) == []
    assert cli.check(["go", "--slow"]) == ["fl-secure go has no option --slow"]
    assert "no sub-command 'stop'" in cli.check(["stop"])[0]
