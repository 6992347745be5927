"""Megatron-LM's own vocabulary, torch-free: its command line read as its parser reads it (options, with the option
table of a pinned Megatron-LM commit in options.json) and the implementation its arguments select (implementation).
Shared by `plan --megatron-args` and the ledger's reader of Megatron-LM runs (ledger/evidence/megatron)."""
