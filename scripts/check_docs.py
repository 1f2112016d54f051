"""Check that the shell commands shown in README.md and docs/**/*.md are not stale.

Every command line of a fenced code block (```bash, ```sh, ```shell, ```console or a fence
without a language) and every inline code span that starts with a known command is checked:

- ``fl-secure ...`` (or ``.venv/bin/fl-secure ...``): the sub-command path must exist and
  every option must belong to it, judged by the real argument parser. The parser is found
  through the ``fl-secure`` console script of ``pyproject.toml`` (``[project.scripts]``), never
  through a hard-coded module path: a function of the entry point's module that returns an
  ``argparse.ArgumentParser``, else the parser the entry point builds (caught when it parses),
  else the text of ``fl-secure <sub-command> --help``. Option values that are not
  placeholders are checked with the option's own type and choices.
- ``make X``: X must be a target of the Makefile.
- ``python X.py ...`` (``benchmarks/``, ``scripts/``, any ``.venv/bin/python``): the script
  must exist and every ``--flag`` used must appear in its ``--help`` output. (A flag that an
  ``add_argument`` call of the script's source names literally is taken as registered without
  starting the script: its ``--help`` runs only for the other flags, which keeps the check
  fast when a script imports torch.)
- a path into the repository named in any of these commands (``examples/...``, ``docs/...``,
  ``benchmarks/...``, ``scripts/...``, ``proto/...``, ``tests/...``) must exist.

Placeholders are fine: upper-case words (``RUN``, ``DIR``, ``FILE``, ``RUN_DIR``, ``N``),
``<id>``, ``...``, ``{a,b}`` (each choice is checked where the option has choices) and
``[optional parts]``.

Usage: ``python scripts/check_docs.py [--root DIR] [FILE ...]``; prints one line per stale
command (``file:line: problem: command``) and a summary, and exits 1 when any is stale.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import os
import re
import shlex
import subprocess
import sys
import tomllib
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CONSOLE_SCRIPT = "fl-secure"
SHELL_LANGUAGES = frozenset({"", "bash", "sh", "shell", "console", "shell-session"})
REPO_DIRS = ("examples", "docs", "benchmarks", "scripts", "proto", "tests")
OUTPUT_OPTIONS = ("--out", "-o")
HELP_TIMEOUT_S = 180

FENCE = re.compile(r"^\s*(`{3,}|~{3,})\s*([\w+-]*)")
INLINE_CODE = re.compile(r"(?<!`)`([^`\n]+(?:\n[^`\n]+)*)`(?!`)")
PLACEHOLDER = re.compile(r"<[^<>]*>|\.\.\.|\{[^{}]*\}|(?<![A-Za-z])[A-Z][A-Z0-9_]*(?![a-z])")
NEGATIVE_NUMBER = re.compile(r"^-\.?\d")
WRAPPERS: dict[str, set[str]] = {  # wrapper -> its options that take a value
    "nice": {"-n"},
    "time": set(),
    "timeout": {"-s", "-k"},
    "nohup": set(),
    "env": set(),
}
ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


@dataclass(frozen=True)
class Command:
    """One command as written in a Markdown file."""

    path: Path
    line: int
    text: str


@dataclass(frozen=True)
class Problem:
    """A stale command: where it is, what it says and what is wrong with it."""

    path: Path
    line: int
    command: str
    message: str

    def render(self, root: Path) -> str:
        """``file:line: message: command``, with the file relative to ``root`` if inside it."""
        try:
            shown: Path | str = self.path.resolve().relative_to(root.resolve())
        except ValueError:
            shown = self.path
        return f"{shown}:{self.line}: {self.message}: {self.command}"


# --- finding the commands ---------------------------------------------------------------------


def markdown_files(root: Path) -> list[Path]:
    """README.md and every Markdown file under docs/, in a stable order."""
    files = [root / "README.md"] if (root / "README.md").is_file() else []
    return files + sorted((root / "docs").rglob("*.md"))


def _is_command(text: str) -> bool:
    tokens = text.split()
    if not tokens:
        return False
    head = tokens[0]
    return (
        _is_cli(head)
        or head == "make"
        or (_is_python(head) and len(tokens) > 1 and tokens[1].endswith(".py"))
    )


def _is_cli(word: str) -> bool:
    return word == CONSOLE_SCRIPT or word.endswith("/" + CONSOLE_SCRIPT)


def _is_python(word: str) -> bool:
    return re.fullmatch(r"(?:\S*/)?python(?:3(?:\.\d+)?)?", word) is not None


def extract_commands(path: Path, text: str | None = None) -> list[Command]:
    """The command lines of ``path``'s shell code blocks and its inline command spans.

    In a code block a line ending in a backslash continues on the next; a leading ``$ `` (a
    console prompt) is dropped. Outside code blocks, an inline code span is a command when it
    starts with ``fl-secure``, ``make`` or ``python X.py`` (a span may wrap over lines).
    """
    if text is None:
        text = path.read_text(encoding="utf-8")
    commands: list[Command] = []
    prose: list[str] = []  # the text outside code blocks, code blocks blanked (keeps lines)
    fence: str | None = None
    shell = False
    pending: tuple[int, str] | None = None
    for number, line in enumerate(text.splitlines(), start=1):
        match = FENCE.match(line)
        if fence is None and match:
            fence, shell = match.group(1), match.group(2).lower() in SHELL_LANGUAGES
            prose.append("")
            continue
        if fence is not None:
            prose.append("")
            if line.strip().startswith(fence) and not line.strip().strip(fence[0]):
                fence, pending = None, None
                continue
            if not shell:
                continue
            body = line.strip()
            if pending is not None:
                start, body = pending[0], pending[1] + " " + body
            else:
                start = number
                body = body.removeprefix("$ ")
            if body.endswith("\\"):
                pending = (start, body[:-1].rstrip())
                continue
            pending = None
            if body and not body.startswith("#"):
                commands.append(Command(path, start, body))
            continue
        prose.append(line)
    joined = "\n".join(prose)
    for match in INLINE_CODE.finditer(joined):
        span = " ".join(match.group(1).split())
        if _is_command(span):
            line_number = joined.count("\n", 0, match.start()) + 1
            commands.append(Command(path, line_number, span))
    return sorted(commands, key=lambda c: c.line)


# --- splitting a command line -----------------------------------------------------------------


def split_segments(text: str) -> list[list[str]]:
    """Shell words of each simple command of ``text`` (split at ``&&``, ``||``, ``;``, ``|``).

    Comments are dropped; ``<id>``-style placeholders are kept as one word.
    """
    text = re.sub(r"<([^<>\s]*)>", lambda m: "__LT__" + m.group(1) + "__GT__", text)
    lexer = shlex.shlex(text, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    try:
        words = list(lexer)
    except ValueError:  # unbalanced quotes: fall back to whitespace
        words = text.split()
    segments: list[list[str]] = [[]]
    for word in words:
        word = word.replace("__LT__", "<").replace("__GT__", ">")
        if word and set(word) <= set(";&|"):
            segments.append([])
        else:
            segments[-1].append(word)
    return [_unwrap(s) for s in segments if s]


def _unwrap(words: list[str]) -> list[str]:
    """Drop variable assignments and wrappers (``nice -n 10``, ``time``) before a command."""
    i = 0
    while i < len(words):
        word = words[i]
        if ASSIGNMENT.match(word):
            i += 1
        elif word in WRAPPERS:
            i += 1
            while i < len(words) and words[i].startswith("-"):
                i += 2 if words[i] in WRAPPERS[word] else 1
            if word == "timeout":
                i += 1  # the duration
        else:
            break
    return words[i:]


def _clean(words: Iterable[str]) -> list[str]:
    """Words without the brackets of optional parts and without ``...`` and ``|`` fillers."""
    cleaned = []
    for word in words:
        word = word.strip("[]")
        if word and word not in ("...", "|"):
            cleaned.append(word)
    return cleaned


def is_placeholder(word: str) -> bool:
    """True when ``word`` holds a placeholder (``RUN``, ``<id>``, ``{a,b}``, ``...``)."""
    return PLACEHOLDER.search(word) is not None


def expand_braces(word: str) -> list[str]:
    """``examples/{a,b}.toml`` -> ``examples/a.toml``, ``examples/b.toml`` (one level)."""
    match = re.search(r"\{([^{}]*,[^{}]*)\}", word)
    if not match:
        return [word]
    return [
        word[: match.start()] + part + word[match.end() :] for part in match.group(1).split(",")
    ]


def _is_option(word: str) -> bool:
    return word.startswith("-") and len(word) > 1 and not NEGATIVE_NUMBER.match(word)


# --- the CLI ----------------------------------------------------------------------------------


def console_script_target(root: Path, name: str = CONSOLE_SCRIPT) -> str:
    """``module:function`` of the console script ``name`` in ``root/pyproject.toml``."""
    with (root / "pyproject.toml").open("rb") as f:
        scripts = tomllib.load(f).get("project", {}).get("scripts", {})
    if name not in scripts:
        raise LookupError(f"pyproject.toml declares no console script {name!r}")
    return str(scripts[name])


class CLIChecker:
    """Judges ``fl-secure ...`` words against the real argument parser."""

    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser

    def check(self, words: Sequence[str]) -> list[str]:
        """Problems of one command's words after the program name (empty when it parses)."""
        problems: list[str] = []
        parser = self.parser
        path = [CONSOLE_SCRIPT]
        words = _clean(words)
        i = 0
        while i < len(words):
            word = words[i]
            i += 1
            if _is_option(word):
                flag, eq, inline = word.partition("=")
                action = _options(parser).get(flag)
                if action is None:
                    problems.append(f"{' '.join(path)} has no option {flag}")
                    continue
                values = [inline] if eq else []
                if not eq:
                    wanted = _value_count(action)
                    while i < len(words) and len(values) < wanted and not _is_option(words[i]):
                        values.append(words[i])
                        i += 1
                problems.extend(_check_values(" ".join(path), flag, action, values))
                continue
            sub = _subparsers(parser)
            if sub is not None:
                if word not in sub.choices:
                    known = ", ".join(sorted(sub.choices))
                    problems.append(f"{' '.join(path)} has no sub-command {word!r} ({known})")
                    return problems
                parser = sub.choices[word]
                path.append(word)
            elif not _positionals(parser):
                problems.append(f"{' '.join(path)} takes no argument {word!r}")
        return problems


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {s: a for a in parser._actions for s in a.option_strings}


def _subparsers(parser: argparse.ArgumentParser) -> Any:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action
    return None


def _positionals(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [
        a
        for a in parser._actions
        if not a.option_strings and not isinstance(a, argparse._SubParsersAction)
    ]


def _value_count(action: argparse.Action) -> int:
    nargs = action.nargs
    if nargs is None or nargs == "?":
        return 1
    if isinstance(nargs, int):
        return nargs
    return sys.maxsize  # "*", "+", REMAINDER


def _check_values(
    where: str, flag: str, action: argparse.Action, values: list[str]
) -> Iterator[str]:
    convert: Callable[[str], Any] | None = action.type if callable(action.type) else None
    for value in values:
        candidates = expand_braces(value) if action.choices else [value]
        for candidate in candidates:
            if is_placeholder(candidate):
                continue
            try:
                converted = convert(candidate) if convert is not None else candidate
            except (argparse.ArgumentTypeError, ValueError, TypeError) as exc:
                yield f"{where} {flag}: invalid value {candidate!r} ({exc})"
                continue
            if action.choices is not None and converted not in action.choices:
                allowed = ", ".join(map(str, action.choices))
                yield f"{where} {flag}: {candidate!r} is not one of {allowed}"


class HelpTextCLI:
    """Fallback without a parser object: ``fl-secure <sub-command> --help`` in a subprocess."""

    def __init__(self, target: str, root: Path) -> None:
        self.target = target
        self.root = root
        self._helps: dict[tuple[str, ...], str | None] = {}

    def help_text(self, path: tuple[str, ...]) -> str | None:
        """The help of ``fl-secure *path``, or None when it does not exist."""
        if path not in self._helps:
            self._helps[path] = self._help_text(path)
        return self._helps[path]

    def _help_text(self, path: tuple[str, ...]) -> str | None:
        module, _, function = self.target.partition(":")
        code = (
            f"import sys; sys.argv[0] = {CONSOLE_SCRIPT!r}; "
            f"from {module} import {function} as main; sys.exit(main())"
        )
        result = _run([sys.executable, "-c", code, *path, "--help"], self.root)
        return result.stdout if result.returncode == 0 else None

    def check(self, words: Sequence[str]) -> list[str]:
        """Problems of one command's words (sub-commands exist, options are in the help)."""
        words = _clean(words)
        path: list[str] = []
        for word in words:
            if _is_option(word):
                break
            text = self.help_text(tuple(path))
            choices = _help_choices(text or "")
            if not choices:
                break
            if word not in choices:
                shown = " ".join([CONSOLE_SCRIPT, *path])
                return [f"{shown} has no sub-command {word!r} ({', '.join(sorted(choices))})"]
            path.append(word)
        text = self.help_text(tuple(path)) or ""
        shown = " ".join([CONSOLE_SCRIPT, *path])
        return [
            f"{shown} has no option {flag}" for flag in _flags(words) if not _mentions(text, flag)
        ]


def _help_choices(text: str) -> set[str]:
    match = re.search(r"\{([\w,-]+)\}", text)
    return set(match.group(1).split(",")) if match else set()


def _import_from(root: Path, module: str) -> Any:
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    return importlib.import_module(module)


def _returns_parser(function: Callable[..., Any]) -> bool:
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return False
    if any(p.default is inspect.Parameter.empty for p in signature.parameters.values()):
        return False
    annotation = signature.return_annotation
    if isinstance(annotation, str):
        return annotation.split(".")[-1] == "ArgumentParser"
    return isinstance(annotation, type) and issubclass(annotation, argparse.ArgumentParser)


class _Captured(Exception):  # a signal, not an error
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser


def _capture_parser(entry: Callable[..., Any]) -> argparse.ArgumentParser | None:
    """The parser ``entry`` builds: stopped at its first ``parse_args``."""

    def capture(self: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> Any:
        raise _Captured(self)

    cls: Any = argparse.ArgumentParser
    saved = (cls.parse_args, cls.parse_known_args, sys.argv)
    cls.parse_args = cls.parse_known_args = capture
    sys.argv = [CONSOLE_SCRIPT]
    try:
        if inspect.signature(entry).parameters:
            entry([])
        else:
            entry()
    except _Captured as captured:
        return captured.parser
    except (Exception, SystemExit):  # noqa: S110  (no parser to find this way)
        pass
    finally:
        cls.parse_args, cls.parse_known_args, sys.argv = saved
    return None


def load_cli(root: Path) -> CLIChecker | HelpTextCLI:
    """A checker for ``fl-secure`` commands, found through pyproject.toml's console script."""
    target = console_script_target(root)
    module_name, _, function_name = target.partition(":")
    module = _import_from(root, module_name)
    builders = [
        obj
        for name, obj in vars(module).items()
        if inspect.isfunction(obj) and obj.__module__ == module.__name__ and _returns_parser(obj)
    ]
    builders.sort(key=lambda f: "parser" not in f.__name__)  # prefer build_parser & co.
    for builder in builders:
        parser = builder()
        if isinstance(parser, argparse.ArgumentParser):
            return CLIChecker(parser)
    entry = getattr(module, function_name, None)
    if callable(entry):
        parser = _capture_parser(entry)
        if parser is not None:
            return CLIChecker(parser)
    return HelpTextCLI(target, root)


# --- scripts, Makefile, paths -----------------------------------------------------------------


def _run(argv: list[str], root: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH", "")]))
    try:
        return subprocess.run(
            argv, cwd=root, env=env, capture_output=True, text=True, timeout=HELP_TIMEOUT_S
        )
    except subprocess.TimeoutExpired as exc:
        return subprocess.CompletedProcess(argv, 124, "", f"timed out: {exc}")


def script_help(root: Path, script: str) -> tuple[bool, str]:
    """``(ok, text)`` of ``python script --help`` run in ``root``."""
    result = _run([sys.executable, script, "--help"], root)
    if result.returncode != 0:
        return False, (result.stderr.strip().splitlines() or ["no output"])[-1]
    return True, result.stdout


def declared_options(path: Path) -> set[str]:
    """Option strings passed as literals to ``add_argument`` calls in a script's source.

    A cheap first look: a flag found here is registered with the script's parser, so its
    ``--help`` need not run; a flag not found here is judged by the ``--help`` output.
    """
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError):
        return set()
    options = set()
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "add_argument"
        ):
            for arg in node.args:
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    if arg.value.startswith("-"):
                        options.add(arg.value)
    return options


def make_targets(root: Path) -> set[str]:
    """The targets the Makefile defines (rule heads and ``.PHONY``)."""
    makefile = root / "Makefile"
    if not makefile.is_file():
        return set()
    targets: set[str] = set()
    for line in makefile.read_text(encoding="utf-8").splitlines():
        match = re.match(r"^([^\s:=#][^:=#]*?)\s*::?(?!=)(.*)$", line)
        if not match:
            continue
        heads = match.group(1).split()
        if heads == [".PHONY"]:
            targets.update(match.group(2).split())
        else:
            targets.update(h for h in heads if not h.startswith("$"))
    return targets


def _flags(words: Iterable[str]) -> list[str]:
    return [w.partition("=")[0] for w in _clean(words) if _is_option(w)]


def _mentions(text: str, flag: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text) is not None


def repo_paths(words: Iterable[str]) -> list[tuple[str, bool]]:
    """``(path, is_output)`` of the words (or ``key=value`` values) naming a repository path.

    A path given to ``--out`` is an output: only its folder has to exist.
    """
    found = []
    previous = ""
    for word in _clean(words):
        for part in (word, word.partition("=")[2]):
            if part.split("/", 1)[0] in REPO_DIRS and "/" in part:
                found.append((part, previous in OUTPUT_OPTIONS or word.startswith("--out=")))
        previous = word
    return found


def path_problem(root: Path, path: str, is_output: bool = False) -> str | None:
    """Why ``path`` (relative to ``root``, maybe with placeholders) is stale, or None."""
    for candidate in expand_braces(path):
        if (root / candidate).exists():
            continue
        if is_output and (root / candidate.rstrip("/")).parent.is_dir():
            continue
        if is_placeholder(candidate):  # the fixed folders before the placeholder must exist
            prefix = PLACEHOLDER.split(candidate, maxsplit=1)[0]
            folder = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
            if not folder or (root / folder).is_dir():
                continue
            return f"no folder {folder}/ (in {path})"
        return f"no file {candidate}"
    return None


# --- the check --------------------------------------------------------------------------------


@dataclass
class Checker:
    """Checks commands against one repository (its CLI, Makefile, scripts and files)."""

    root: Path
    _cli: CLIChecker | HelpTextCLI | None = None
    _targets: set[str] | None = None

    @property
    def cli(self) -> CLIChecker | HelpTextCLI:
        """The CLI checker, loaded on first use."""
        if self._cli is None:
            self._cli = load_cli(self.root)
        return self._cli

    @property
    def targets(self) -> set[str]:
        """The Makefile's targets, read on first use."""
        if self._targets is None:
            self._targets = make_targets(self.root)
        return self._targets

    def scripts_of(self, commands: Iterable[Command]) -> set[str]:
        """The scripts whose ``--help`` the commands need.

        Those that exist and are given a flag that no ``add_argument`` of their source names.
        """
        needed = set()
        for command in commands:
            for words in split_segments(command.text):
                if len(words) > 1 and _is_python(words[0]) and words[1].endswith(".py"):
                    script = self.root / words[1]
                    if script.is_file() and set(_flags(words[2:])) - declared_options(script):
                        needed.add(words[1])
        return needed

    def check(self, commands: Sequence[Command]) -> list[Problem]:
        """Every problem of ``commands``."""
        scripts = sorted(self.scripts_of(commands))
        uses_cli = any(
            _is_cli(words[0]) for c in commands for words in split_segments(c.text) if words
        )
        with ThreadPoolExecutor(max_workers=max(1, min(4, len(scripts)))) as pool:
            running = pool.map(lambda s: script_help(self.root, s), scripts)
            if uses_cli:
                _ = self.cli  # import the CLI while the scripts print their help
            helps = dict(zip(scripts, running, strict=True))
        problems = []
        for command in commands:
            for message in self.check_command(command.text, helps):
                problems.append(Problem(command.path, command.line, command.text, message))
        return problems

    def check_command(self, text: str, helps: dict[str, tuple[bool, str]]) -> list[str]:
        """Problems of one command line (all its ``&&``/``;``/``|`` parts)."""
        problems: list[str] = []
        for words in split_segments(text):
            head, rest = words[0], words[1:]
            if _is_cli(head):
                problems += self.cli.check(rest)
            elif head == "make":
                for target in _clean(rest):
                    if not target.startswith("-") and "=" not in target:
                        if not is_placeholder(target) and target not in self.targets:
                            known = ", ".join(sorted(self.targets))
                            problems.append(f"the Makefile has no target {target!r} ({known})")
            elif _is_python(head) and rest and rest[0].endswith(".py"):
                script, args = rest[0], rest[1:]
                if not is_placeholder(script) and not (self.root / script).is_file():
                    problems.append(f"no script {script}")
                    continue
                flags = sorted(set(_flags(args)) - declared_options(self.root / script))
                if flags and script in helps:
                    ok, text_ = helps[script]
                    if not ok:
                        problems.append(f"{script} --help failed: {text_}")
                        continue
                    problems += [
                        f"{script} has no option {flag}"
                        for flag in flags
                        if not _mentions(text_, flag)
                    ]
            else:
                continue
            for path, is_output in repo_paths(rest):
                message = path_problem(self.root, path, is_output)
                if message:
                    problems.append(message)
        return problems


def check_files(files: Sequence[Path], root: Path = ROOT) -> tuple[list[Command], list[Problem]]:
    """The commands of ``files`` and the problems found in them."""
    commands = [c for f in files for c in extract_commands(f)]
    return commands, Checker(root).check(commands)


def check_repository(root: Path = ROOT) -> tuple[list[Command], list[Problem]]:
    """The commands of README.md and docs/**/*.md of ``root`` and their problems."""
    return check_files(markdown_files(root), root)


def main(argv: list[str] | None = None) -> int:
    """Print every stale command and a summary; 1 when any command is stale."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=ROOT, help="repository root")
    parser.add_argument(
        "files", nargs="*", type=Path, help="Markdown files (default: README.md, docs/**/*.md)"
    )
    args = parser.parse_args(argv)
    root = args.root.resolve()
    files = args.files or markdown_files(root)
    commands, problems = check_files(files, root)
    for problem in problems:
        print(problem.render(root))
    stale = len({(p.path, p.line, p.command) for p in problems})
    print(
        f"check_docs: {len(commands)} commands in {len(files)} Markdown files; "
        + (f"{stale} stale ({len(problems)} problems)" if problems else "none stale")
    )
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
