"""The `foundry` subcommands: thin shells that parse flags and call into the subpackages.

Each module exposes ``register(subparsers)``, which adds its parser(s) and sets ``func``
to a callable taking the parsed ``argparse.Namespace`` and returning an exit code.
"""
