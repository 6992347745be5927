"""`python -m cli COMMAND ...`: the same as the `train-ledger` script."""
from cli.main import entry

entry()
