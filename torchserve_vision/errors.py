"""The failures the command reports: library code raises a `CommandError` (or a subclass that
names its layer); only the CLI turns it into `error: <message>` and an exit status. Imports
nothing, so every layer can use it."""

from __future__ import annotations


class CommandError(Exception):
    """A failure the command reports with its message and exit status 1."""


class NotServed(CommandError):
    """The command needs a model that the server does not serve."""


class LabError(CommandError):
    """A lab measurement cannot run as asked."""
