"""The torch-free bottom layer: the config schema the manifest stores, the Megatron flag parser, errors, the
run-directory contract and the catalogue of what a rank computes (ops/). Everything else may import it; it imports
nothing of the project."""
