"""The named models of --model PRESET: a ModelConfig's fields by name (common.arguments builds the config)."""
from __future__ import annotations

from typing import Any

# Shapes only; tying is --untie-embeddings-and-output-weights (tied without it, as Megatron). The seeds' shape is
# llama3.2-1b (L16 h2048 f8192 32/8 heads vocab 128256): 1,235,814,400 parameters tied, as the real Llama-3.2-1B,
# 1,498,482,688 untied, as the seeds' scripts run it. The real Llama-3.1-8B is untied: pass the flag.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(num_layers=4, hidden_size=64, ffn_hidden_size=176, num_attention_heads=8, num_query_groups=4,
                 vocab_size=1000, seq_length=32, max_position_embeddings=32, rotary_base=10000.0,
                 make_vocab_size_divisible_by=8),
    "llama3.2-1b": dict(num_layers=16, hidden_size=2048, ffn_hidden_size=8192, num_attention_heads=32,
                        num_query_groups=8, vocab_size=128256, seq_length=4096, max_position_embeddings=131072,
                        rotary_base=500000.0),
    "llama3.1-8b": dict(num_layers=32, hidden_size=4096, ffn_hidden_size=14336, num_attention_heads=32,
                        num_query_groups=8, vocab_size=128256, seq_length=8192, max_position_embeddings=131072,
                        rotary_base=500000.0),
    "llama3.1-70b": dict(num_layers=80, hidden_size=8192, ffn_hidden_size=28672, num_attention_heads=64,
                         num_query_groups=8, vocab_size=128256, seq_length=8192, max_position_embeddings=131072,
                         rotary_base=500000.0),
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
