"""One module per `train-ledger` command; each exposes main(argv) -> exit status."""
