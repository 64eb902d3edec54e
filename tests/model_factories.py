"""Model factories a user would write (pkg.module:function) for `autopar trace` and
`autopar execute --model`: transformers models built from a config, no weights."""

from tests.hf_configs import TINY_DECODER


def tiny_llama():
    import transformers

    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY_DECODER))
