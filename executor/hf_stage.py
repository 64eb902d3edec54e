"""One pipeline stage of a Hugging Face causal LM, keeping the model's own module paths.

The stage holds the transformers model's base model under its own name ("model",
"transformer") and, on the last stage, `lm_head`, so "model.layers.3.self_attn.q_proj" in the
plan is that module here. Layers outside the stage become pass-throughs (their indices, and
with them per-layer attention types such as Gemma-2's sliding windows, stay as they were);
the final norm runs on the last stage only. The stage then calls transformers' own forward:
token ids on the first stage, hidden states (`inputs_embeds`) on the others, logits on the
last. Two families change what `inputs_embeds` means and are corrected on later stages: GPT-2
adds learned positions to it, Granite's base models multiply it by `embedding_multiplier`.
(Gemma scales in its embedding module, GemmaTextScaledWordEmbedding, since transformers 5:
its `inputs_embeds` are taken as they are.) Every stage is given the micro-batch's
`position_ids` where the user packs documents, and runs without a key/value cache (with one,
transformers does not mask attention by documents); under sequence parallelism it passes
the whole sequence's positions and masks (the model would size them by its shard).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from executor.errors import ExecutionError

FINAL_NORMS = ("norm", "ln_f", "final_layernorm", "final_layer_norm")
# model types whose base forward multiplies `inputs_embeds` by config.embedding_multiplier
SCALES_INPUT_EMBEDS = frozenset({"granite", "granitemoe", "granitemoeshared"})


class PassThrough(nn.Module):
    """Stands for a decoder layer another stage runs."""

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return hidden_states


class ZeroPositions(nn.Module):
    """GPT-2's position table on a later stage: the first stage added positions already."""

    def __init__(self, hidden: int):
        super().__init__()
        self.hidden = hidden

    def forward(self, position_ids: torch.Tensor) -> torch.Tensor:
        return torch.zeros(*position_ids.shape, self.hidden, device=position_ids.device)


def layer_list(base: nn.Module) -> tuple[str, nn.ModuleList]:
    """The base model's decoder layers: its ModuleList with one entry per hidden layer."""
    n = base.config.num_hidden_layers
    for name, child in base.named_children():
        if isinstance(child, nn.ModuleList) and len(child) == n:
            return name, child
    raise ValueError(f"{type(base).__name__} has no ModuleList of {n} decoder layers")


def _shallow_copy(module: nn.Module) -> nn.Module:
    """A new module object sharing `module`'s children and parameters, whose own child slots
    can be replaced without touching the original (a rank may cut several stages, as with
    interleaving, from one model)."""
    twin = copy.copy(module)
    twin._modules = dict(module._modules)
    return twin


class HFStage(nn.Module):
    def __init__(self, lm: nn.Module, start: int, end: int, first: bool, last: bool):
        super().__init__()
        self.first, self.last = first, last
        self.prefix = lm.base_model_prefix
        lm = _shallow_copy(lm)
        base = _shallow_copy(getattr(lm, self.prefix))
        setattr(lm, self.prefix, base)
        self.model_type = lm.config.model_type
        self.layers_name, layers = layer_list(base)
        layers = nn.ModuleList(list(layers))
        setattr(base, self.layers_name, layers)
        self.block_keys = [str(i) for i in range(start, end)]
        for i in range(len(layers)):
            if not start <= i < end:
                layers[i] = PassThrough()
        if not first:
            for name, child in list(base.named_children()):
                if child is lm.get_input_embeddings():
                    setattr(base, name, None)  # a later stage takes hidden states
            if self.model_type == "gpt2":
                base.wpe = ZeroPositions(lm.config.hidden_size)
        if not last:
            for name in FINAL_NORMS:
                if isinstance(getattr(base, name, None), nn.Module):
                    setattr(base, name, nn.Identity())
        setattr(self, self.prefix, base)
        if last:
            self.lm_head = lm.lm_head
        object.__setattr__(self, "_lm", lm)  # its forward, not a second copy of its modules
        self.position_ids: torch.Tensor | None = None
        # sequence parallelism: the sequence's length, which transformers would otherwise
        # count from its embeddings' output, a sequence shard, for positions and masks
        self.sequence_length: int | None = None

    @property
    def head_name(self) -> str | None:
        return "lm_head" if self.last else None

    def owned_blocks(self) -> dict[str, nn.Module]:
        layers = getattr(getattr(self, self.prefix), self.layers_name)
        return {key: layers[int(key)] for key in self.block_keys}

    def set_block(self, key: str, module: nn.Module) -> None:
        getattr(getattr(self, self.prefix), self.layers_name)[int(key)] = module

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """`position_ids` (batch, sequence), packed documents': each document's positions
        count from 0, and transformers' masks keep attention within each document."""
        base = getattr(self, self.prefix)
        # context parallelism: the global positions of the rank's tokens
        # (executor.context_parallel.apply_context_parallel)
        at = {} if self.position_ids is None else {"position_ids": self.position_ids[None]}
        if position_ids is not None:
            at = {"position_ids": position_ids}
        if self.position_ids is None and self.sequence_length is not None:
            whole = torch.arange(self.sequence_length, device=x.device)
            given = position_ids if position_ids is not None else whole[None]
            at = {"position_ids": given, "cache_position": whole}
            at["attention_mask"] = self._whole_sequence_masks(x, at)
        # no key/value cache in training; with one, transformers also skips the packed
        # documents' mask (it keeps attention within each document only without a cache)
        at["use_cache"] = False
        if self.first:
            if self.last:
                return self._lm(input_ids=x, **at).logits
            return base(input_ids=x, **at).last_hidden_state
        if self.model_type in SCALES_INPUT_EMBEDS:
            x = x / torch.tensor(self._lm.config.embedding_multiplier, dtype=x.dtype)
        if self.last:
            return self._lm(inputs_embeds=x, **at).logits
        return base(inputs_embeds=x, **at).last_hidden_state

    def _whole_sequence_masks(self, x: torch.Tensor, at: dict):
        """Under sequence parallelism, the attention masks of the whole sequence, made by
        transformers' own mask functions: a model sizes them by its embeddings' output, here
        a sequence shard, while its attention sees the whole sequence (the layout gathers it).
        A mask per layer type where the config lists them (Gemma 2/3, Qwen 2/3: the model
        takes the mapping), else the one mask the model makes (sliding-window where the
        config has a window: Mistral's rule). None where attention needs none (sdpa's causal
        flag): the model's own, made from the shard, is then None too."""
        from transformers import masking_utils

        config = self._lm.config
        # the dtype the model's embeddings output: the mask's (eager attention adds it)
        dtype = self._lm.get_input_embeddings().weight.dtype if self.first else x.dtype
        stand_in = torch.empty(x.shape[0], self.sequence_length, 1, dtype=dtype, device=x.device)
        args = {
            "config": config,
            "inputs_embeds": stand_in,
            "attention_mask": None,
            "cache": None,
            "position_ids": at["position_ids"],
        }
        makers = {
            "full_attention": masking_utils.create_causal_mask,
            "sliding_attention": masking_utils.create_sliding_window_causal_mask,
        }
        kinds = sorted(set(getattr(config, "layer_types", None) or ()))
        if unknown := [k for k in kinds if k not in makers]:
            raise ExecutionError(
                f"{self.model_type}: layer types {unknown} have no whole-sequence mask under "
                f"sequence parallelism (known: {sorted(makers)})"
            )
        if kinds:
            return {kind: makers[kind](**args) for kind in kinds}
        sliding = getattr(config, "sliding_window", None) is not None
        return makers["sliding_attention" if sliding else "full_attention"](**args)
