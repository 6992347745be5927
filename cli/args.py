"""The argparse flavour every command uses: errors raise ConfigError (one line, exit 2) instead of exiting."""
from __future__ import annotations

import argparse

from common.errors import ConfigError


class CommandParser(argparse.ArgumentParser):
    def __init__(self, command: str, **kwargs):
        super().__init__(prog=f"train-ledger {command}", allow_abbrev=False, **kwargs)

    def error(self, message: str) -> None:
        raise ConfigError(message)
