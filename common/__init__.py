"""The torch-free bottom layer: the config schema the manifest stores, the Megatron flag parser, errors
and the run-directory contract. Everything else may import it; it imports nothing of the project."""
