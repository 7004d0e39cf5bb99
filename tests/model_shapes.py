"""Model configs the advisor tests share (real shapes; no weights are ever built from them)."""

# Llama-3.1-8B's shape.
LLAMA_8B = {
    "model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 14336, "vocab_size": 128256,
    "tie_word_embeddings": False, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
    "dtype": "bfloat16",
}
