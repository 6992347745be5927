"""User-facing errors: the CLI turns each into one line on stderr and exit status 2, never a traceback."""
from __future__ import annotations


class UserError(Exception):
    """Bad input from the user (flags, configs, files)."""


class ConfigError(UserError, ValueError):
    """A flag or configuration value that cannot run."""


class InputError(UserError):
    """A file that cannot be read as what it claims to be; the message names the file."""

    def __init__(self, path: object, problem: str):
        super().__init__(f"{path}: {problem}")
        self.path = path
        self.problem = problem

    def __reduce__(self) -> tuple[type, tuple[object, str]]:
        """Rebuilt from (path, problem), not from the message: a worker process raises it to its parent pickled."""
        return type(self), (self.path, self.problem)
