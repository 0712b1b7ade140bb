"""Click options generated from the declarations in llmc.contract.options.

A command names the declared options it takes and gets them as one value: `options` (a
BuildOptions), `runtime` (a dict of RuntimeOptions values, None where not given) or `server` (a
ServerOptions). Each flag's name, default, help, type and choices are its declaration's, so the
CLI cannot disagree with the library; `options_markdown` renders the same declarations as
docs/options.md.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import click

from llmc.contract.options import BuildOptions, Option, RuntimeOptions, ServerOptions, declaration, declarations

OPTION_CLASSES = (BuildOptions, RuntimeOptions, ServerOptions)

_CLICK_TYPES = {"int": click.INT, "float": click.FLOAT, "str": click.STRING, "bool": click.BOOL}


def click_type(declared: Option) -> click.ParamType:
    """The click type of a declared option: its annotation without `| None`, a tuple's items' type."""
    base = declared.type.split(" | ")[0]
    if base.startswith("tuple["):
        base = base.removeprefix("tuple[").split(",")[0]
    return _CLICK_TYPES[base]


def click_default(declared: Option, tuning: bool | None) -> tuple[Any, str | None]:
    """(click default, the default in words or None where click shows the value). A runtime option
    (`tuning` not None) defaults to None, "not given": the runtime then applies tuning.json's value
    where the command reads it (`tuning`), else the declared default. A build or server option
    defaults to its declared value."""
    if tuning is None:
        return declared.default, declared.default_text
    shown = declared.shown_default
    if tuning and declared.tunable:
        shown = f"tuning.json, else {shown}"
    return None, shown or None


def click_option(declared: Option, tuning: bool | None = None) -> Callable:
    """The click option of a declaration (`tuning`: see click_default). A default in words goes
    into the help as `[default: ...]`, where click would put it in parentheses."""
    default, in_words = click_default(declared, tuning)
    help = f"{declared.help} [default: {in_words}]" if in_words else declared.help
    kwargs: dict[str, Any] = dict(help=help, default=default, show_default=in_words is None)
    if declared.type == "bool":
        kwargs["is_flag"] = True
    else:
        kwargs["type"] = click_type(declared)
        kwargs["multiple"] = declared.type.startswith("tuple[")
        choices = "|".join(map(str, declared.choices)) if declared.choices else None
        kwargs["metavar"] = declared.metavar or choices
    return click.option(declared.flag, declared.name, **kwargs)


def grouped(options: list[Callable], names: Iterable[str], into: str, make: Callable[[dict], Any]) -> Callable:
    """A decorator that adds `options` to a command, which receives the values of `names` as one
    keyword argument, `into` = make(values) (so a command takes each group once)."""
    names = tuple(names)

    def decorate(command):
        @functools.wraps(command)  # keeps the options declared below this decorator
        def with_group(**kwargs):
            values = {name: kwargs.pop(name) for name in names}
            return command(**kwargs, **{into: make(values)})

        for option in reversed(options):
            with_group = option(with_group)
        return with_group

    return decorate


def build_options() -> Callable:
    """Every BuildOptions option; the command receives `options`, a BuildOptions (checked)."""
    declared = declarations(BuildOptions)
    return grouped([click_option(d) for d in declared], [d.name for d in declared], "options",
                   lambda values: BuildOptions(**values))


def runtime_options(*names: str, tuning: bool = True) -> Callable:
    """These RuntimeOptions options; the command receives `runtime`, {name: value, None where not
    given}. `tuning`: whether the command applies the engine's tuning.json (its help says so)."""
    options = [click_option(declaration(RuntimeOptions, name), tuning) for name in names]
    return grouped(options, names, "runtime", dict)


def server_options(*names: str) -> Callable:
    """These ServerOptions options; the command receives `server`, a ServerOptions (checked)."""
    options = [click_option(declaration(ServerOptions, name)) for name in names]
    return grouped(options, names, "server", lambda values: ServerOptions(**values))


# -- docs/options.md ------------------------------------------------------------------------------

_SECTIONS = {
    BuildOptions: ("Build options", "`llmc build` flags; the engine's manifest records them (`BuildOptions`)."),
    RuntimeOptions: ("Runtime options", "Keywords of `LLM(...)`/`AsyncLLM(...)` (`RuntimeOptions`); the tunable "
                                        "ones are what `llmc tune` searches and writes to tuning.json, which a "
                                        "flag or keyword overrides."),
    ServerOptions: ("Server options", "`llmc serve` flags (`ServerOptions`); Ray Serve's `app_builder` takes "
                                      "them, and the runtime options, by name."),
}


def _commands_taking(group: click.Group, name: str) -> list[str]:
    return [command for command, cmd in sorted(group.commands.items())
            if any(isinstance(p, click.Option) and p.name == name for p in cmd.params)]


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def options_table(cls: type, group: click.Group) -> str:
    """A markdown table of `cls`'s declared options, with the `group` commands that take each."""
    tunable = cls is RuntimeOptions
    rows = ["| Option | Flag | Default | Values | " + ("Tunable | " if tunable else "") + "What it does |",
            "|---|---|---|---|" + ("---|" if tunable else "") + "---|"]
    for d in declarations(cls):
        commands = _commands_taking(group, d.name)
        flag = f"`{d.flag}` ({', '.join(commands)})" if commands else ""
        tuned = ("yes |" if d.tunable else " |") if tunable else ""
        rows.append(f"| `{d.name}` | {_cell(flag)} | {_cell(d.shown_default)} | {_cell(d.values)} | {tuned} "
                    f"{_cell(d.help)} |".replace("|  ", "| "))
    return "\n".join(rows) + "\n"


OPTIONS_DOC = "docs/options.md"
REGENERATE = ("python -c 'from llmc.cli import main; from llmc.cli_options import options_markdown; "
              "print(options_markdown(main), end=\"\")' > docs/options.md")


def options_markdown(group: click.Group) -> str:
    """docs/options.md: every declared option, generated (a test checks the file is up to date)."""
    parts = ["# Options\n",
             "Generated from the declarations in `llmc/contract/options.py` (one per option: default, help, "
             "flag, values); do not edit by hand. Regenerate with:\n",
             f"```\n{REGENERATE}\n```\n",
             "The Flag column names the `llmc` commands that take the option; a runtime flag left out applies "
             "the engine's tuning.json value where the command reads it, else the default.\n"]
    for cls, (title, intro) in _SECTIONS.items():
        parts += [f"## {title}\n", f"{intro}\n", options_table(cls, group)]
    return "\n".join(parts)


def declared_flags() -> Mapping[str, Option]:
    """Every declared option by its flag(s): `--verify` and `--no-verify` both name `verify`."""
    return {flag: d for cls in OPTION_CLASSES for d in declarations(cls) for flag in d.flag.split("/")}
