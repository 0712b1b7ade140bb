"""Each option is declared once (llmc.contract.options) and everything else is generated from it:
the CLI's flags, the server's defaults, Ray Serve's config and docs/options.md. These tests compare
each generated form with the declarations, so a default or help text written a second time, and
then changed in one place only, fails here."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

import click
import pytest

from llmc.cli import main
from llmc.cli_options import (OPTION_CLASSES, OPTIONS_DOC, REGENERATE, click_type, declared_flags,
                              options_markdown)
from llmc.contract.options import (BuildOptions, RuntimeOptions, ServerOptions, declaration, declarations,
                                   option)
from llmc.errors import LlmcError
from llmc.server import app as server_app

ROOT = Path(__file__).resolve().parent.parent


def _declared(name: str):
    """(class, declaration) of a declared option name."""
    for cls in OPTION_CLASSES:
        if name in {f.name for f in dataclasses.fields(cls)}:
            return cls, declaration(cls, name)
    return None, None


def _cli_options():
    """(command name, click option) for every option of every command."""
    return [(name, p) for name, command in sorted(main.commands.items()) for p in command.params
            if isinstance(p, click.Option)]


def test_every_option_field_is_declared_with_help():
    for cls in OPTION_CLASSES:
        for d in declarations(cls):
            assert d.help and d.help.endswith((".", ")", "]")), (cls.__name__, d.name)
            assert d.flag.startswith("--"), d


def test_declared_defaults_are_the_dataclasses_defaults():
    for cls in OPTION_CLASSES:
        built = cls()
        for d in declarations(cls):
            assert getattr(built, d.name) == d.default == getattr(cls, d.name), (cls.__name__, d.name)


@pytest.mark.parametrize("command,param", _cli_options(), ids=[f"{c}-{p.name}" for c, p in _cli_options()])
def test_a_cli_option_of_a_declared_name_is_the_declaration(command, param):
    cls, d = _declared(param.name)
    if d is None:
        # Not a declared option: it must not take a declared option's flag under another name.
        taken = {flag: declared_flags()[flag].name for flag in param.opts + param.secondary_opts
                 if flag in declared_flags()}
        assert not taken, f"llmc {command} {param.opts[0]} spells a declared option's flag: {taken}"
        return
    assert "/".join(param.opts + param.secondary_opts) == d.flag
    assert param.help.startswith(d.help)
    if d.type == "bool":
        assert param.is_flag
    else:
        assert param.type == click_type(d)
        assert param.multiple == d.type.startswith("tuple[")
        if d.choices is not None:
            assert param.metavar == "|".join(map(str, d.choices))
    if cls is RuntimeOptions:
        # None is "not given": the runtime applies tuning.json or the declared default, which the help names.
        assert param.default is None
        assert param.help.endswith(f"{d.shown_default}]")
    else:
        assert param.default == d.default
        if d.default_text is not None:
            assert param.help.endswith(f"[default: {d.default_text}]")
        else:
            assert param.show_default


def test_the_cli_takes_every_build_and_server_option():
    build = {p.name for p in main.commands["build"].params}
    serve = {p.name for p in main.commands["serve"].params}
    assert {d.name for d in declarations(BuildOptions)} <= build
    assert {d.name for d in declarations(ServerOptions)} <= serve


def test_the_cli_builds_with_the_declared_options(monkeypatch, tmp_path):
    """`llmc build --passes` with no flags: the pipeline of BuildOptions(), the declared defaults."""
    from click.testing import CliRunner

    seen = []
    monkeypatch.setattr("llmc.passes.pipeline.phases", lambda options: seen.append(options) or [])
    result = CliRunner().invoke(main, ["build", "--passes"])
    assert result.exit_code == 0, result.output
    assert seen == [BuildOptions()]
    CliRunner().invoke(main, ["build", "--passes", "--asymmetric", "--quant", "int4", "--disable-pass", "x"])
    assert seen[-1] == BuildOptions(quant_symmetric=False, quant="int4", disable_passes=("x",))


def test_a_bad_declared_value_is_a_one_line_cli_error():
    from click.testing import CliRunner

    result = CliRunner().invoke(main, ["build", "--passes", "--quant", "int3"])
    assert (result.exit_code, result.output.strip()) == (2, "error: --quant must be one of none, int8, int6, int4 "
                                                            "(got 'int3')")
    result = CliRunner().invoke(main, ["serve", "x", "--replicas", "0"])
    assert (result.exit_code, result.output.strip()) == (2, "error: --replicas must be an integer >= 1 and <= 256 "
                                                            "(got 0)")


@pytest.mark.parametrize("flags, message", [
    # It printed "serving" and then hung (issue 63).
    (["--port", "70000"], "error: --port must be an integer >= 0 and <= 65535 (got 70000)"),
    (["--max-waiting", "-1"], "error: --max-waiting must be an integer >= 0 and <= 1000000 (got -1)"),
    (["--grace-period", "-5"], "error: --grace-period must be a number >= 0 and <= 86400 (got -5.0)"),
])
def test_server_flags_out_of_range_stop_serve_before_it_starts(flags, message):
    from click.testing import CliRunner

    result = CliRunner().invoke(main, ["serve", "x", *flags])
    assert (result.exit_code, result.output.strip()) == (2, message)


def test_awq_without_quant_is_refused_rather_than_built_in_fp32():
    """--quant-method awq --calibrate without --quant built an fp32 engine, exit 0 (issue 63)."""
    from click.testing import CliRunner

    result = CliRunner().invoke(main, ["build", "--passes", "--quant-method", "awq", "--calibrate", "README.md"])
    assert result.exit_code == 2 and result.output.strip() == (
        "error: --quant-method awq calibrates the projections --quant quantizes, and --quant is none; add --quant "
        "int4 or int8, or drop --quant-method awq")


def test_the_server_takes_its_defaults_from_the_declarations():
    params = inspect.signature(server_app.create_app).parameters
    assert params["max_waiting"].default == ServerOptions().max_waiting


def test_ray_serve_takes_its_defaults_and_config_from_the_declarations():
    ray_serve = pytest.importorskip("llmc.server.ray_serve", reason="needs Ray Serve")
    params = inspect.signature(ray_serve.application).parameters
    assert params["max_waiting"].default == ServerOptions().max_waiting
    assert params["grace_period"].default == ServerOptions().grace_period
    slots = RuntimeOptions().max_num_seqs
    assert ray_serve.engine_load({}, slots) == 1.0  # a replica not yet reporting has the declared batch slots
    # `serve run ... key=value` gives text: each value is parsed by its declared type and checked.
    args = ray_serve.application_args({"engine": "e", "replicas": "3", "threads": "1", "max_waiting": "9",
                                       "grace_period": "2.5", "max_num_seqs": "8", "allow_spinning": "false",
                                       "speculative": "ngram"})
    assert args == {"engine": "e", "model": None, "replicas": 3, "threads": 1, "max_waiting": 9, "grace_period": 2.5,
                    "options": {"max_num_seqs": 8, "allow_spinning": False, "speculative": "ngram"}}
    with pytest.raises(LlmcError, match=r"^max_num_seqs must be an integer >= 1 and <= 4096 \(got 'many'\)$"):
        ray_serve.application_args({"engine": "e", "max_num_seqs": "many"})
    with pytest.raises(ValueError, match="unknown argument 'max_num_seq'"):
        ray_serve.application_args({"engine": "e", "max_num_seq": "8"})


def test_docs_options_md_is_generated_from_the_declarations():
    text = (ROOT / OPTIONS_DOC).read_text(encoding="utf-8")
    assert text == options_markdown(main), f"{OPTIONS_DOC} is out of date; regenerate it: {REGENERATE}"
    for cls in OPTION_CLASSES:
        for d in declarations(cls):
            assert f"| `{d.name}` |" in text


def test_option_flags_and_bool_pairs():
    @dataclasses.dataclass(frozen=True)
    class Example:
        on: bool = option(True, "On by default.")
        off: bool = option(False, "Off by default.")
        named: int | None = option(None, "Named.", flag="--other", low=1)

    by_name = {d.name: d for d in declarations(Example)}
    assert by_name["on"].flag == "--on/--no-on" and by_name["off"].flag == "--off"
    assert by_name["named"].flag == "--other" and by_name["named"].values == ">= 1"
    assert by_name["named"].parse("none") is None and by_name["named"].parse("4") == 4
