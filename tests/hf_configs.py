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

# mistralai/Mixtral-8x7B-v0.1's config.json (46.7B: 8 experts, top 2): the benches plan it
# whole; the export checks take its sizes with fewer layers.
MIXTRAL_8X7B = {
    "architectures": ["MixtralForCausalLM"],
    "model_type": "mixtral",
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 32768,
    "rope_theta": 1e6,
    "rms_norm_eps": 1e-05,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
}

# Qwen/Qwen3-30B-A3B config.json (its published values, written by hand): torchtitan's
# qwen3 "30B-A3B" flavor has this shape (api/export/torchtitan.py)
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "max_position_embeddings": 40960,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-06,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "attention_bias": False,
}
