"""The ``shardtune estimate`` outputs quoted in the docs are what the command prints now.

Every console block of README.md and docs/*.md that runs ``shardtune estimate`` is run again at the docs' width (80
columns); each stretch of the quoted output between ``...`` elisions must appear in the real output, whitespace
aside. A formula change that moves a figure fails here until the page is regenerated. The docs' links resolve inside
the repository, and every option a docs command gives a subcommand is one that subcommand takes.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def estimate_blocks() -> list[tuple[str, str, list[str]]]:
    """(page, command line, quoted stretches) of every console block that runs shardtune estimate."""
    found = []
    for page in PAGES:
        for block in re.findall(r"```console\n(.*?)```", page.read_text(), flags=re.S):
            lines = block.splitlines()
            if not lines or not lines[0].startswith("$ shardtune estimate "):
                continue
            stretches, current = [], []
            for line in lines[1:]:
                if line.strip() == "...":
                    stretches.append(current)
                    current = []
                else:
                    current.append(line)
            stretches.append(current)
            quoted = [" ".join(" ".join(s).split()) for s in stretches if any(x.strip() for x in s)]
            found.append((page.name, lines[0][2:], quoted))
    return found


BLOCKS = estimate_blocks()


def test_the_docs_quote_estimate_outputs():
    assert len(BLOCKS) >= 4  # choosing-a-setup.md alone quotes four


@pytest.mark.parametrize("page, command, quoted", BLOCKS, ids=[f"{p}: {c[19:70]}" for p, c, _ in BLOCKS])
def test_quoted_estimate_output_is_current(page, command, quoted, capsys, monkeypatch):
    from shardtune.cli import main

    monkeypatch.setenv("COLUMNS", "80")
    monkeypatch.chdir(ROOT)  # paths in the commands are the repository's
    assert main(shlex.split(command)[1:]) == 0
    printed = " ".join(capsys.readouterr().out.split())
    for stretch in quoted:
        assert stretch in printed, f"{page}: '{command}' no longer prints:\n{stretch}\n\nit prints:\n{printed}"


def estimate_commands() -> list[tuple[str, str]]:
    """(page, command) of every ``shardtune estimate`` line in the docs' bash blocks, $BASE the demo's model, less
    those that read what another step makes (out/..., the reader's own .gguf) or trace (test_trace times that)."""
    found = []
    for page in PAGES:
        for block in re.findall(r"```(?:bash|sh)\n(.*?)```", page.read_text(), flags=re.S):
            for line in block.replace("\\\n", " ").splitlines():
                command = line.split("  #")[0].strip().replace("$BASE", str(ROOT / "shardtune/demo/base_model"))
                if (command.startswith("shardtune estimate") and "--trace" not in command and " out/" not in command
                        and ".gguf" not in command):
                    found.append((page.name, command))
    return found


COMMANDS = estimate_commands()


@pytest.mark.parametrize("page, command", COMMANDS, ids=[f"{p}: {c[19:80]}" for p, c in COMMANDS])
def test_estimate_commands_in_the_docs_run(page, command, tmp_path, capsys, monkeypatch):
    from shardtune.cli import main

    assert len(COMMANDS) >= 5
    monkeypatch.chdir(tmp_path)  # what a command writes (--emit-config recipe.yaml) lands here
    assert main(shlex.split(command)[1:]) == 0, f"{page}: '{command}' fails: {capsys.readouterr().err[-500:]}"


def test_the_readme_names_every_estimate_option():
    """The README's list of estimate options leaves none out (--help aside)."""
    from shardtune.cli import build_parser

    sub = next(a for a in build_parser("estimate")._actions if a.choices and "estimate" in a.choices)
    readme = " ".join((ROOT / "README.md").read_text().split())
    options = {o for action in sub.choices["estimate"]._actions for o in action.option_strings if o.startswith("--")}
    named = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)(?![\w-])", readme))
    named |= {f"--{o}" for pair in re.findall(r"--\[no-\]([a-z0-9-]+)", readme) for o in (pair, f"no-{pair}")}
    missing = sorted(options - {"--help"} - named)
    assert not missing, f"README.md does not name estimate's {missing}"


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_links_between_the_docs_resolve_inside_the_repository():
    """Every relative link of README.md and docs/*.md names a file of the repository, and its #anchor a heading."""
    broken = []
    for page in PAGES:
        for link in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if link.startswith(("http://", "https://")):
                continue
            path, _, anchor = link.partition("#")
            target = (page.parent / path).resolve() if path else page
            if not target.is_relative_to(ROOT) or not target.exists():
                broken.append(f"{page.name}: {link} (no such file in the repository)")
            elif anchor and target.suffix == ".md":
                headings = re.findall(r"^#+ (.*)$", target.read_text(), flags=re.M)
                if anchor not in {github_anchor(h) for h in headings}:
                    broken.append(f"{page.name}: {link} (no such heading)")
    assert not broken, "\n".join(broken)


def docs_commands() -> list[tuple[str, str]]:
    """(page, command) of every ``shardtune ...`` the docs show, in code spans and in bash or console blocks."""
    found = []
    for page in PAGES:
        text = page.read_text()
        commands = re.findall(r"`(shardtune [^`]+)`", text)
        for block in re.findall(r"```(?:bash|sh|console)\n(.*?)```", text, flags=re.S):
            lines = (line.removeprefix("$ ").split("  #")[0] for line in block.replace("\\\n", " ").splitlines())
            commands += [line for line in lines if line.startswith("shardtune ")]
        found += [(page.name, " ".join(command.split())) for command in commands]
    return found


def test_every_option_the_docs_give_a_subcommand_is_one_it_takes():
    """An option shown after ``shardtune estimate|generate|chat|export|merge|plot|bench ...`` is in its parser
    (train, launch and data inspect take the training keys, which docs/config.md and test_docs_config check)."""
    from shardtune.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.choices and "estimate" in a.choices)
    taken = {name: parser for name, parser in sub.choices.items()}
    for name, parser in list(taken.items()):
        for action in parser._actions:
            if isinstance(action.choices, dict):
                taken |= {f"{name} {inner}": p for inner, p in action.choices.items()}
    options = {name: {o for a in p._actions for o in a.option_strings} for name, p in taken.items()}
    unknown = []
    for page, command in docs_commands():
        words = command.split()
        name = " ".join(words[1:3]) if " ".join(words[1:3]) in options else words[1]
        assert name in options, f"{page}: '{command}' names no shardtune subcommand"
        if name in ("train", "launch", "data inspect"):
            continue
        unknown += [f"{page}: {word} in '{command}'" for word in words[2:]
                    if word.startswith("--") and word.split("=")[0] not in options[name]]
    assert not unknown, "\n".join(unknown)
