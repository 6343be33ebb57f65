"""Command-line flags declared once: name, type, default, help text and environment twin.

A command builds its parser from `FlagGroup`s. `FlagParser` reads each flag's environment
twin (`SHOAL_<FLAG_NAME>` unless declared otherwise) while it parses, so a flag given on the
command line wins, a malformed variable is a one-line error naming it (exit status 2), and
the help text and docs/configuration.md are both made from the same declarations.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

TRUE_WORDS = frozenset({"1", "true", "yes", "on"})
FALSE_WORDS = frozenset({"0", "false", "no", "off"})
KINDS = ("value", "switch", "toggle", "append", "positional")
_EXPECTED = {int: "an integer", float: "a number"}


class _Unset:
    def __repr__(self) -> str:
        return "<unset>"


UNSET = _Unset()  # the argparse default of every flag: "not on the command line"


def env_name(flag: str) -> str:
    """The environment twin of a flag: `max-num-seqs` -> `SHOAL_MAX_NUM_SEQS`."""
    return "SHOAL_" + flag.upper().replace("-", "_")


def parse_bool(text: str) -> bool:
    """1/0, true/false, yes/no, on/off, in any case."""
    word = text.strip().lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    raise ValueError("expected 1/0, true/false, yes/no or on/off")


def non_negative_float(text: str) -> float:
    """A number of at least 0 (a flag's type)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected a number of at least 0, got {text}")
    return value


@dataclass(frozen=True)
class Flag:
    """One flag. kind: value (`--x V`), switch (`--x`, off by default), toggle (`--x` and
    `--no-x`), append (repeatable `--x V`), positional. env: True for `SHOAL_<NAME>`, False
    for none, or the variable's name. shown_default: the default in words for help and docs
    (otherwise the default itself; nothing when there is none)."""

    name: str
    help: str
    type: Callable[[str], Any] = str
    default: Any = None
    env: bool | str = True
    kind: str = "value"
    choices: Sequence[str] | None = None
    metavar: str | None = None
    required: bool = False
    shown_default: str | None = None
    exclusive: str | None = None  # flags sharing this label exclude each other

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"flag {self.name}: kind {self.kind!r} is not one of {KINDS}")
        if self.kind in ("append", "positional") and self.env:
            raise ValueError(f"flag {self.name}: a {self.kind} flag has no environment twin")

    @property
    def dest(self) -> str:
        return self.name.replace("-", "_")

    @property
    def env_var(self) -> str | None:
        """The environment variable that sets this flag, if any."""
        if self.env is True:
            return env_name(self.name)
        return self.env or None

    @property
    def option(self) -> str:
        """How the flag is written: `--max-num-seqs`, `--[no-]enforce-eager`, `NAME`."""
        if self.kind == "positional":
            return self.metavar or self.name.upper()
        if self.kind == "toggle":
            return f"--[no-]{self.name}"
        return f"--{self.name}"

    def default_words(self) -> str:
        """The default as help and docs show it ("" when there is none to show)."""
        if self.shown_default is not None:
            return self.shown_default
        if self.kind == "switch" or (self.kind == "toggle" and isinstance(self.default, bool)):
            return "on" if self.default else "off"
        if self.default is None or self.kind in ("append", "positional"):
            return ""
        return str(self.default)

    def help_text(self) -> str:
        """The help line: text, default and environment twin (escaped for argparse)."""
        text = self.help
        if self.required:
            text += " (required)"
        elif words := self.default_words():
            text += f" (default: {words})"
        if self.env_var:
            text += f" [env {self.env_var}]"
        return text.replace("%", "%%")


@dataclass(frozen=True)
class FlagGroup:
    """Flags shown together under one title; `about` is its paragraph in the docs."""

    title: str
    flags: tuple[Flag, ...]
    about: str = ""


class FlagParser(argparse.ArgumentParser):
    """An ArgumentParser that fills flags not on the command line from their environment
    twins, then from their declared defaults."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.flag_groups: list[FlagGroup] = []

    def add_group(self, group: FlagGroup) -> None:
        """Add every flag of `group` under its title."""
        section = self.add_argument_group(group.title)
        exclusive: dict[str, argparse._MutuallyExclusiveGroup] = {}
        for flag in group.flags:
            target = section
            if flag.exclusive is not None:
                if flag.exclusive not in exclusive:
                    exclusive[flag.exclusive] = section.add_mutually_exclusive_group()
                target = exclusive[flag.exclusive]
            _add_argument(target, flag)
        self.flag_groups.append(group)

    def flags(self) -> list[Flag]:
        return [flag for group in self.flag_groups for flag in group.flags]

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        namespace, extras = super().parse_known_args(args, namespace)
        for flag in self.flags():
            if flag.kind == "positional":
                continue
            value = getattr(namespace, flag.dest, UNSET)
            if value is UNSET or (flag.kind == "append" and value is None):
                setattr(namespace, flag.dest, self._fallback(flag))
            if flag.required and getattr(namespace, flag.dest) is None:
                twin = f" (or {flag.env_var})" if flag.env_var else ""
                self.error(f"the following arguments are required: {flag.option}{twin}")
        return namespace, extras

    def _fallback(self, flag: Flag) -> Any:
        """The flag's value from its environment twin, else its default."""
        var = flag.env_var
        raw = os.environ.get(var, "") if var else ""
        if raw == "":
            if flag.kind == "append":
                return list(flag.default or [])
            return bool(flag.default) if flag.kind == "switch" else flag.default
        try:
            value = parse_bool(raw) if flag.kind in ("switch", "toggle") else flag.type(raw)
        except (ValueError, TypeError, argparse.ArgumentTypeError) as e:
            reason = _EXPECTED.get(flag.type)
            self.exit(2, f"{self.prog}: error: {var}={raw!r}: {_reason(reason, e)}\n")
        if flag.choices is not None and value not in flag.choices:
            options = ", ".join(map(str, flag.choices))
            self.exit(2, f"{self.prog}: error: {var}={raw!r}: expected one of {options}\n")
        return value


def _reason(expected: str | None, error: Exception) -> str:
    return f"expected {expected}" if expected else str(error)


def _add_argument(target: Any, flag: Flag) -> None:
    help_text = flag.help_text()
    if flag.kind == "positional":
        target.add_argument(flag.dest, type=flag.type, metavar=flag.metavar, help=help_text)
        return
    option = f"--{flag.name}"
    if flag.kind == "switch":
        target.add_argument(option, action="store_true", default=UNSET, help=help_text)
    elif flag.kind == "toggle":
        # created with default None so that argparse does not add its own default words
        action = target.add_argument(
            option, action=argparse.BooleanOptionalAction, default=None, help=help_text
        )
        action.default = UNSET
    else:
        target.add_argument(
            option,
            type=flag.type,
            choices=flag.choices,
            metavar=flag.metavar,
            default=None if flag.kind == "append" else UNSET,
            action="append" if flag.kind == "append" else "store",
            help=help_text,
        )


def flag_values(args: argparse.Namespace, group: FlagGroup) -> dict[str, Any]:
    """dest -> value of each flag of `group` that has a value (None ones left out)."""
    values = {f.dest: getattr(args, f.dest) for f in group.flags}
    return {name: value for name, value in values.items() if value is not None}


def flag_argv(args: argparse.Namespace, group: FlagGroup) -> list[str]:
    """The flags of `group` that have a value, as command-line words for a child process."""
    words: list[str] = []
    for flag in group.flags:
        value = getattr(args, flag.dest)
        if value is None or flag.kind == "positional":
            continue
        if flag.kind == "toggle":
            words.append(f"--{flag.name}" if value else f"--no-{flag.name}")
        elif flag.kind == "switch":
            words += [f"--{flag.name}"] if value else []
        elif flag.kind == "append":
            words += [w for item in value for w in (f"--{flag.name}", str(item))]
        else:
            words += [f"--{flag.name}", str(value)]
    return words


def markdown_table(group: FlagGroup) -> str:
    """The flags of `group` as a Markdown table: flag, environment twin, default, meaning."""
    rows = ["| flag | env | default | meaning |", "|---|---|---|---|"]
    for flag in group.flags:
        env = f"`{flag.env_var}`" if flag.env_var else ""
        default = "required" if flag.required else flag.default_words()
        if flag.choices is not None:
            default += f" (one of {', '.join(map(str, flag.choices))})"
        cells = [f"`{flag.option}`", env, default.strip(), flag.help]
        rows.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return "\n".join(rows)
