"""``shardtune config schema``: the JSON Schema of a recipe, so that editors validate and complete recipe YAML.

    shardtune config schema > shardtune.schema.json

then put ``# yaml-language-server: $schema=shardtune.schema.json`` on a recipe's first line (VS Code's YAML
support reads it). The schema is made from the keys' declarations, as docs/config.md and ``train --help-keys`` are.
"""

from __future__ import annotations

import argparse
import json

from shardtune.cli.common import action_parsers


def register(sub: argparse._SubParsersAction) -> None:
    actions = action_parsers(sub, "config", "the recipe's JSON Schema, for editors", __doc__)
    actions.add_parser("schema", help="print the JSON Schema of a recipe (docs/config.md's keys)", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter).set_defaults(func=print_schema)


def print_schema(args: argparse.Namespace) -> int:  # noqa: ARG001
    from shardtune.config.recipe_schema import recipe_schema

    print(json.dumps(recipe_schema(), indent=2))
    return 0
