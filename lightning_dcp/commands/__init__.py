"""Subcommands of the ``lightning-dcp`` CLI (see :mod:`lightning_dcp.cli`)."""
