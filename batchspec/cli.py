"""The `batchspec` command line: one click group; each subcommand lives next to the code it
drives and is registered here."""
from __future__ import annotations

import logging

import click


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-v", "--verbose", count=True, help="More logging (-v info, -vv debug).")
@click.pass_context
def cli(ctx: click.Context, verbose: int):
    """batchspec: offline batch LLM generation with speculative decoding."""
    level = logging.WARNING - 10 * min(verbose, 2)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    ctx.ensure_object(dict)


# Modules that define a COMMANDS list of click commands.
COMMAND_MODULES = ["batchspec.jobs.commands", "batchspec.report.command",
                   "batchspec.tools.bench", "batchspec.tools.evaluate", "batchspec.tools.distill",
                   "batchspec.tools.convert", "batchspec.tools.vocab"]


def _register():
    import importlib
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name != name:
                raise
            continue
        for cmd in module.COMMANDS:
            cli.add_command(cmd)


def main():
    _register()
    cli(obj={})


if __name__ == "__main__":
    main()
