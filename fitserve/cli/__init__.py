"""The ``fitserve`` command: entry point (main), the shared engine flags (engine_args) and the
serve command. Subcommands that are offline tools are imported from fitserve.tools on demand."""

from fitserve.cli.main import main

__all__ = ["main"]
