"""``shardcal recipes``: the shipped recipes as a table, or one recipe's file and notes."""

from __future__ import annotations

import argparse

from .commands import command


def _recipes_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "name", nargs="?", metavar="NAME", help="print this shipped recipe's TOML and notes instead of the table"
    )


@command(
    "recipes",
    help="choose a recipe: the shipped recipes by scheme, where each export runs, measured quality and time "
    "(NAME: its TOML and notes)",
    arguments=_recipes_arguments,
)
def _recipes(args: argparse.Namespace) -> int:
    from ..calib.recipes import shipped_recipe_path
    from ..pipeline.chooser import recipe_notes, recipe_table

    if args.name is not None:
        text = shipped_recipe_path(args.name).read_text(encoding="utf-8")
        print(text.rstrip("\n") + "\n\n" + "\n".join(recipe_notes(args.name)))
        return 0
    print(recipe_table())
    return 0
