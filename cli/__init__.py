"""`train-ledger`, the command line on top of every layer: one module per command."""
