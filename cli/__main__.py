"""`python -m cli COMMAND ...`: the same as the `train-ledger` script."""
import sys

from cli.main import main

sys.exit(main())
