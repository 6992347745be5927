"""The named models of --model PRESET: a ModelConfig's fields by name (common.arguments builds the config).

Each preset is its published model, the output layer's tying included (a config.json's tie_word_embeddings): a
preset that leaves untie_embeddings_and_output_weights out is tied, Megatron's default. The flag
--untie-embeddings-and-output-weights unties any of them; no flag ties. Each published parameter count is held by
tests/test_presets.py: llama3.2-1b 1,235,814,400 (tied), llama3.1-8b 8,030,261,248 and llama3.1-70b 70,553,706,496
(untied), mixtral-8x7b 46,702,792,704 (untied).
"""
from __future__ import annotations

from typing import Any

PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(num_layers=4, hidden_size=64, ffn_hidden_size=176, num_attention_heads=8, num_query_groups=4,
                 vocab_size=1000, seq_length=32, max_position_embeddings=32, rotary_base=10000.0,
                 make_vocab_size_divisible_by=8),
    "llama3.2-1b": dict(num_layers=16, hidden_size=2048, ffn_hidden_size=8192, num_attention_heads=32,
                        num_query_groups=8, vocab_size=128256, seq_length=4096, max_position_embeddings=131072,
                        rotary_base=500000.0),
    "llama3.1-8b": dict(num_layers=32, hidden_size=4096, ffn_hidden_size=14336, num_attention_heads=32,
                        num_query_groups=8, vocab_size=128256, seq_length=8192, max_position_embeddings=131072,
                        rotary_base=500000.0, untie_embeddings_and_output_weights=True),
    "llama3.1-70b": dict(num_layers=80, hidden_size=8192, ffn_hidden_size=28672, num_attention_heads=64,
                         num_query_groups=8, vocab_size=128256, seq_length=8192, max_position_embeddings=131072,
                         rotary_base=500000.0, untie_embeddings_and_output_weights=True),
    # GPT-3 175B (Brown et al. 2020) as Megatron-LM trains it: Megatron's defaults without --swiglu,
    # --disable-bias-linear, --normalization RMSNorm or --position-embedding-type rope (GeLU MLP of 4h, biases,
    # LayerNorm, learned positions), the GPT-2 BPE vocabulary: 174,604,836,864 parameters at tp 1 (~174.6B).
    # For the ledger's formulas (simulate / search); the engine implements the Llama style only.
    "gpt3-175b": dict(num_layers=96, hidden_size=12288, ffn_hidden_size=49152, num_attention_heads=96,
                      num_query_groups=96, vocab_size=50257, seq_length=2048, max_position_embeddings=2048,
                      swiglu=False, add_bias_linear=True, normalization="LayerNorm",
                      position_embedding_type="learned_absolute"),
    # Mixtral 8x7B (Jiang et al. 2024; the public config.json): Llama-style layers whose MLP is 8 SwiGLU experts of
    # f 14336, each token routed to 2, untied output layer: 46,702,792,704 parameters (docs/formulas.md, "Mixture of
    # experts"). The "-2l" cut keeps its shape at 2 layers (3.16 B parameters, ~57 GB of bf16 Adam state on one rank),
    # so that one H200 trains it.
    "mixtral-8x7b": dict(num_layers=32, hidden_size=4096, ffn_hidden_size=14336, num_attention_heads=32,
                         num_query_groups=8, vocab_size=32000, seq_length=4096, max_position_embeddings=32768,
                         rotary_base=1000000.0, num_experts=8, moe_router_topk=2,
                         untie_embeddings_and_output_weights=True),
    "mixtral-8x7b-2l": dict(num_layers=2, hidden_size=4096, ffn_hidden_size=14336, num_attention_heads=32,
                            num_query_groups=8, vocab_size=32000, seq_length=4096, max_position_embeddings=32768,
                            rotary_base=1000000.0, num_experts=8, moe_router_topk=2,
                            untie_embeddings_and_output_weights=True),
}

# Where each preset's tying comes from, in words for `plan`.
TYING_SOURCES: dict[str, str] = {
    "tiny": "the tiny preset: Megatron's default",
    "llama3.2-1b": "Llama-3.2-1B's published config: tie_word_embeddings true",
    "llama3.1-8b": "Llama-3.1-8B's published config: tie_word_embeddings false",
    "llama3.1-70b": "Llama-3.1-70B's published config: tie_word_embeddings false",
    "gpt3-175b": "GPT-3 as Megatron-LM trains it: Megatron's default",
    "mixtral-8x7b": "Mixtral-8x7B's published config: tie_word_embeddings false",
    "mixtral-8x7b-2l": "Mixtral-8x7B's published config: tie_word_embeddings false",
}


def tying_reason(preset: str | None, untied: bool) -> str:
    """Why a model's output layer is tied to its input embedding or not, as a phrase that follows "tied" or
    "untied": its preset's published config, the flag (which unties), Megatron's default (tied), or, for a config a
    run recorded before its preset carried the published tying (a llama3.1 run recorded tied), the record."""
    if preset in PRESETS and PRESETS[preset].get("untie_embeddings_and_output_weights", False) == untied:
        return f"as {TYING_SOURCES[preset]}"
    if untied:
        return "by --untie-embeddings-and-output-weights"
    if preset in PRESETS:
        return f"as the run's config recorded it, before the {preset} preset carried its published tying"
    return "by Megatron's default: no --untie-embeddings-and-output-weights"
