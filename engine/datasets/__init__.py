"""Real training data in Megatron-LM's formats: the indexed dataset (.bin/.idx), GPT samples and blends (numpy only)."""
