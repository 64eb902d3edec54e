"""Build one pipeline stage of a zoo model, keeping the module paths the plan names.

Every rank builds the whole model on the CPU from the same seed (identical initial weights
without a broadcast; fine for the CPU/gloo runs this executor targets first), then keeps its
stage: the embeddings on the first stage, its blocks, the final norm and head on the last.
Blocks live in a ModuleDict keyed by their original index, so "blocks.3.mlp.fc1" in the plan
is "blocks.3.mlp.fc1" here.
"""

from __future__ import annotations

import torch
from torch import nn

from executor.errors import ExecutionError
from executor.hf_stage import HFStage
from planner.errors import InputError
from planner.executable import FAMILIES
from planner.models.registry import resolve_ref

# family -> (embedding attrs, blocks attr, final norm attr, head attr)
PARTS = {
    "gpt": (("wte", "wpe"), "blocks", "ln_f", "lm_head"),
    "moe": (("wte", "wpe"), "blocks", "ln_f", "lm_head"),
    "llama": (("tok_embeddings",), "layers", "norm", "output"),
    "mlp": ((), "blocks", None, None),
}


class StageModule(nn.Module):
    def __init__(
        self, model: nn.Module, family: str, start: int, end: int, first: bool, last: bool
    ):
        super().__init__()
        embeds, blocks, norm, head = PARTS[family]
        self.family, self.first, self.last = family, first, last
        for name in embeds if first else ():
            setattr(self, name, getattr(model, name))
        self.block_attr = blocks
        setattr(
            self,
            blocks,
            nn.ModuleDict({str(i): getattr(model, blocks)[i] for i in range(start, end)}),
        )
        if last and norm:
            setattr(self, norm, getattr(model, norm))
            setattr(self, head, getattr(model, head))
        self._norm, self._head = norm, head

    @property
    def head_name(self) -> str | None:
        return self._head if self.last else None

    def owned_blocks(self) -> dict[str, nn.Module]:
        return dict(getattr(self, self.block_attr).items())

    def set_block(self, key: str, module: nn.Module) -> None:
        getattr(self, self.block_attr)[key] = module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first and self.family in ("gpt", "moe"):
            positions = torch.arange(x.shape[1], device=x.device)
            x = self.wte(x) + self.wpe(positions)
        elif self.first and self.family == "llama":
            x = self.tok_embeddings(x)
        for block in getattr(self, self.block_attr).values():
            x = block(x)
        if self.last and self._norm:
            x = getattr(self, self._head)(getattr(self, self._norm)(x))
        return x


def build_full_model(
    spec: dict, seq: int, seed: int = 0, factory: str | None = None
) -> tuple[nn.Module, str]:
    """The whole model a plan's `request.model` names, on the CPU, initialised from `seed`
    (the same weights on every rank): a zoo model, a Hugging Face model built by
    transformers (its own initialisation, `initializer_range`), or — for a plan made from
    `autopar trace` of the user's factory — what `factory` (pkg.module:function, given on
    the user's own machine; never taken from the plan) returns."""
    family = spec.get("family") or "zoo"
    if family == "graph":
        return _from_factory(spec, factory, seed), family
    try:
        resolved = resolve_ref(family, spec["name"], spec.get("config", {}))
    except InputError as err:
        raise ExecutionError(f"plan.request.model: {err}") from None
    family = resolved.family.name
    if family not in FAMILIES:
        raise ExecutionError(
            f"model family {family!r} is not executable yet ({', '.join(sorted(FAMILIES))})"
        )
    torch.manual_seed(seed)
    model = resolved.with_seq(seq).build(torch.float32, device="cpu").model
    if family != "hf":
        initialize(model)
    return model, family


def _from_factory(spec: dict, factory: str | None, seed: int) -> nn.Module:
    from executor.data import load_factory

    if factory is None:
        raise ExecutionError(
            f"plan.request.model: the plan was made from a trace of {spec.get('name')!r}; "
            "pass its factory with --model PKG.MODULE:FUNCTION"
        )
    torch.manual_seed(seed)
    model = load_factory(factory, "--model")()
    if not isinstance(model, nn.Module):
        raise ExecutionError(f"--model: {factory} returned {type(model).__name__}, not a module")
    return model.float()


INIT_STD = 0.02  # GPT-2/3 and Llama's weight init (Radford et al. 2019; Touvron et al. 2023)


def initialize(model: nn.Module) -> None:
    """Training initialisation of a zoo model (its constructor leaves torch's layer defaults,
    which give logits far from uniform): matrices ~ N(0, 0.02), biases 0, norms as built;
    convolutions Kaiming-normal (fan out), as ResNets train.
    With it the loss at step 0 is close to ln(vocab)."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Conv2d):  # as torchvision's ResNets (He et al. 2015)
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
                continue
            for name, p in module.named_parameters(recurse=False):
                if isinstance(module, nn.LayerNorm | nn.RMSNorm | nn.BatchNorm2d | nn.GroupNorm):
                    continue
                if name == "bias":
                    p.zero_()
                elif p.dim() > 1:
                    p.normal_(0.0, INIT_STD)


def build_stage(model: nn.Module, family: str, start: int, end: int, first: bool, last: bool):
    if family == "hf":
        return HFStage(model, start, end, first, last)
    return StageModule(model, family, start, end, first, last)
