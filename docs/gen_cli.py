"""Generate docs/cli.md, the command-line reference, from impel's argparse parsers so that it cannot drift.

Run in the dev venv: ``.venv/bin/python docs/gen_cli.py`` rewrites docs/cli.md; ``--check`` exits 1 when the file
differs from a fresh generation (``tests/unit/test_docs.py`` checks the same). It walks
``impel.commands.main.build_parser()``: each command's summary, description and usage, and every flag with its
value, default and help. The launch flags are generated from the config dataclasses in ``impel/config/run_config.py``,
so a new
config field shows up here on the next run. Importing the parsers does not import torch.

The text is built from the parsers' actions, not from argparse's own help formatter, whose layout depends on the
terminal width and changes between Python versions: the output is the same on every Python impel supports.
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "cli.md"
REGENERATE = ".venv/bin/python docs/gen_cli.py"
_USAGE_OPTIONS = 6  # usage lists each option up to this many; beyond, "[options]" (the tables list them all)

HEADER = f"""\
# Command-line reference

Generated from the argparse parsers in `impel/commands/` by `docs/gen_cli.py`: do not edit this page by hand
(`tests/unit/test_docs.py` fails when it differs from a fresh generation; `{REGENERATE}` rewrites it).
`impel COMMAND --help` prints the same flags and help texts.

The flags of `impel launch` and `impel test` are generated from the config dataclasses in
`impel/config/run_config.py`: every config key is a flag and a YAML key of the same name (the file's value when the
flag is not given, else the default). Bool flags (value `BOOL`) work alone (`--cpu`) or with a value
(`--fsdp_offload_params false`).
How the config is merged and what `impel launch` does with it: [Configure and launch](launch.md).
"""


def _metavar(action: argparse.Action) -> str:
    if action.metavar is not None:
        return action.metavar if isinstance(action.metavar, str) else " ".join(action.metavar)
    if action.choices is not None:
        return "{" + ",".join(str(c) for c in action.choices) + "}"
    return action.dest.upper() if action.option_strings else action.dest


def _takes_value(action: argparse.Action) -> bool:
    return action.nargs != 0


def _values(action: argparse.Action) -> str:
    """What follows the flag (or stands for the positional) in a usage line, as argparse writes it."""
    if isinstance(action, argparse._SubParsersAction):
        return f"{_metavar(action)} ..."
    name, nargs = _metavar(action), action.nargs
    if isinstance(nargs, int):
        return " ".join([name] * nargs)
    return {"?": f"[{name}]", "*": f"[{name} ...]", "+": f"{name} [{name} ...]",
            argparse.REMAINDER: "..."}.get(nargs, name)  # type: ignore[arg-type]


def _option_usage(action: argparse.Action) -> str:
    text = action.option_strings[0] + (f" {_values(action)}" if _takes_value(action) else "")
    return text if action.required else f"[{text}]"


def _visible(actions: list[argparse.Action]) -> list[argparse.Action]:
    return [a for a in actions if a.help is not argparse.SUPPRESS and not isinstance(a, argparse._HelpAction)]


def _usage(parser: argparse.ArgumentParser) -> str:
    actions = _visible(parser._actions)
    optional = [a for a in actions if a.option_strings]
    required = [a for a in optional if a.required]
    parts = [parser.prog]
    if len(optional) > _USAGE_OPTIONS:
        parts += [_option_usage(a) for a in required] + ["[options]"]
    else:
        parts += [_option_usage(a) for a in optional]
    parts += [_values(a) for a in actions if not a.option_strings]
    return " ".join(parts)


def _help(action: argparse.Action, prog: str) -> str:
    text = action.help or ""
    if "%" in text:  # argparse's own expansion: %(default)s, %(choices)s, %(prog)s, %%
        params = {k: v for k, v in vars(action).items() if v is not argparse.SUPPRESS}
        params["prog"] = prog
        if params.get("choices") is not None:
            params["choices"] = ", ".join(str(c) for c in params["choices"])
        text = text % params
    return " ".join(text.split())


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("<", "&lt;")


def _code(text: str) -> str:
    return f"`{text}`" if text else ""


def _default(action: argparse.Action) -> str:
    if action.default is argparse.SUPPRESS or action.default is None or not _takes_value(action):
        return ""
    return _code(str(action.default))


def _table(actions: list[argparse.Action], prog: str) -> list[str]:
    rows = ["| argument | value | default | what it does |", "|---|---|---|---|"]
    for action in actions:
        flag = ", ".join(f"`{s}`" for s in action.option_strings) or f"`{_metavar(action)}`"
        if action.option_strings:
            value = _code(_values(action)) if _takes_value(action) else ""
            if isinstance(action, argparse._AppendAction):
                value += " (repeatable)"
        else:
            value = {"?": "optional", "*": "any number", "+": "one or more",
                     argparse.REMAINDER: "the rest of the command line"}.get(action.nargs, "")  # type: ignore[arg-type]
        rows.append(f"| {flag} | {value} | {_default(action)} | {_cell(_help(action, prog))} |")
    return rows


def _subcommands(parser: argparse.ArgumentParser) -> list[tuple[str, str, argparse.ArgumentParser]]:
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            summaries = {choice.dest: choice.help or "" for choice in action._choices_actions}
            found += [(name, summaries.get(name, ""), sub) for name, sub in action.choices.items()]
    return found


def _section(parser: argparse.ArgumentParser, summary: str, depth: int) -> list[str]:
    lines = [f"{'#' * depth} `{parser.prog}`", ""]
    if summary:
        lines += [summary[0].upper() + summary[1:] + ("" if summary.endswith(".") else "."), ""]
    if parser.description:
        lines += [" ".join(parser.description.split()), ""]
    lines += ["```text", _usage(parser), "```", ""]
    subs = _subcommands(parser)
    if subs:
        lines += ["| command | what it does |", "|---|---|"]
        lines += [f"| [`{parser.prog} {name}`](#{_anchor(f'{parser.prog} {name}')}) | {_cell(text)} |"
                  for name, text, _ in subs]
        lines.append("")
    for group in parser._action_groups:
        actions = [a for a in _visible(group._group_actions) if not isinstance(a, argparse._SubParsersAction)]
        if not actions:
            continue
        lines += [f"**{_cell(group.title or 'options')}**", ""] + _table(actions, parser.prog) + [""]
    if parser.epilog:
        lines += [" ".join(parser.epilog.split()), ""]
    for _, text, sub in subs:  # the commands are sections of their own, their subcommands one level down
        lines += _section(sub, text, depth if " " not in parser.prog else depth + 1)
    return lines


def _anchor(title: str) -> str:
    """The id Python-Markdown's toc extension (mkdocs) gives a heading `title` (written in a code span)."""
    return re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", title).strip().lower())


def render() -> str:
    from impel.commands.main import build_parser

    parser = build_parser()
    lines = HEADER.splitlines() + [""]
    lines += _section(parser, "", 2)
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        if OUT.exists() and OUT.read_text(encoding="utf-8") == text:
            return 0
        print(f"docs/cli.md is out of date: run {REGENERATE}", file=sys.stderr)
        return 1
    OUT.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main(sys.argv[1:]))
