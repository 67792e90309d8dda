"""The one error class for bad user input.

Whatever a person gives the platform (a config or policy file, a field in it, a data snapshot,
a command-line value, a path) and gets wrong raises `InputError` with one line that names the
field or file and what was expected. Entry points (`atlas`, flows/cli.py) show exactly these
errors (and the registry's and integrity errors) as that one line with exit status 2; any other
exception is a bug and keeps its traceback.

It subclasses ValueError so that code written against ValueError still catches it.
"""

from __future__ import annotations


class InputError(ValueError):
    """Bad input from the user: the message names the field or file and what was expected."""
