"""The ledger's tensor-parallel terms: the layouts' tp events per micro-batch (again where a
layer recomputes) and once a step, as planner.evaluate.ledger adds them per chunk."""

from __future__ import annotations

from planner.parallel.checkpointing import recomputes


def tensor_parallel(
    comm,
    config,
    nodes,
    layouts,
    first_layer: int,
    count,
    reductions=lambda layer: 1,
    step_scale: float = 1.0,
) -> None:
    """The layouts' tp events: forward and backward each micro-batch, per-step events (a
    replicated weight's gradient reduced over tp) once per reduction of the weight's
    gradient over dp, `reductions(layer)`: FSDP2 turns the partial gradient into a
    replicated one as it reduces it, each micro-batch under ZeRO-3, in the compute dtype;
    without FSDP2's reduction over dp (no data parallelism, or ZeRO-1) the gradient stays
    partial until the step reads it, in fp32: `step_scale` its bytes over the layout's.
    A checkpointed layer's forward collectives run again in backward up to its last layer
    with parameters: torch's checkpoint stops recomputing once every tensor backward needs
    is back (early stop), and the last linear layer's output is not one (its input is)."""
    if config.tp == 1:
        return
    m = config.microbatches
    tail = {n.layer: i for i, n in enumerate(nodes) if n.layer is not None and n.params}
    owned_here = {p for n in nodes for p in n.params if p not in n.shared_params}
    for i, node in enumerate(nodes):
        lay = layouts[node.name]
        again = (
            node.layer is not None
            and recomputed(config, node.layer, first_layer, count)
            and i < tail.get(node.layer, -1)
        )
        # under context parallelism a rank holds 1/cp of the tokens the layouts were made for
        for name, nbytes in lay.fwd_comm:
            comm.add(name, "tp", nbytes // config.cp, m * (2 if again else 1))
        for name, nbytes in lay.bwd_comm:
            comm.add(name, "tp", nbytes // config.cp, m)
        for name, nbytes in _step_events(node, lay, owned_here):
            comm.add(name, "tp", round(nbytes * step_scale), reductions(node.layer))


def _step_events(node, lay, owned_here: set[str]) -> list[tuple[str, int]]:
    """A node's once-a-step tp events, less those of a tied weight whose owning use is in
    the same chunk: both uses add into one gradient there, reduced once."""
    events = list(lay.step_comm)
    for name in node.shared_params:
        if name in owned_here and name in node.params:
            nbytes = node.params[name].nbytes
            if ("all_reduce", nbytes) in events:
                events.remove(("all_reduce", nbytes))
    return events


def recomputed(config, layer: int, first_layer: int, count) -> bool:
    """Whether a checkpointed layer's forward runs again in backward."""
    if not recomputes(config.checkpointing):
        return False
    return count is None or layer < first_layer + count
