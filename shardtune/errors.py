"""Errors that reach the user as one line and exit code 2."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class UsageError(Exception):
    """Bad input from the user: the CLI prints the message on one line and exits with code 2."""

    exit_code = 2


def first_line(text: str, default: str = "") -> str:
    """The first line of an error message (``default`` when it is empty): what a one-line report shows."""
    return (text.strip().splitlines() or [default])[0]


def closest(word: str, choices: Iterable[str]) -> str | None:
    """The choice nearest to ``word`` (case-insensitive), or None when nothing is close."""
    choices = list(choices)
    lowered = {c.lower(): c for c in choices}
    match = difflib.get_close_matches(word.lower(), list(lowered), n=1, cutoff=0.5)
    return lowered[match[0]] if match else None


def check_choice(value: str, choices: Iterable[str], what: str) -> str:
    """Return ``value`` if it is one of ``choices`` (case-insensitive), else raise a UsageError naming them."""
    choices = list(choices)
    for choice in choices:
        if value.lower() == choice.lower():
            return choice
    hint = closest(value, choices)
    did_you_mean = f" Did you mean '{hint}'?" if hint else ""
    raise UsageError(f"unknown {what} '{value}': choose one of {', '.join(choices)}.{did_you_mean}")
