"""Shared test configs of Hugging Face models (config.json fields), small enough to run."""

# A two-layer decoder: 4 heads of 16, 2 key/value heads, vocabulary 128.
TINY_DECODER = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}
