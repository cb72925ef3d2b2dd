"""Finding the fully-connected head of a model (Krizhevsky, section 3: conv layers hold ~95% of the compute,
the trailing fully-connected layers ~95% of the parameters).

Automatic: the head is the trailing run of ``nn.Linear`` layers, with the element-wise layers (activations,
dropout) between them, that follows the model's last convolution / pooling / flatten, in the order
``named_modules`` lists the leaves (the order of ``nn.Sequential`` models, and of models that define their
layers in forward order); the search runs over the whole LightningModule, so ``self.backbone`` +
``self.classifier`` works as well as ``self.model``.  Named: ``head="model.classifier"`` (a dotted path from the
searched module) takes that submodule (an ``nn.Sequential`` of linear and element-wise layers, or one
``nn.Linear``).  Anything else is a clear error before training starts, naming what was searched.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

__all__ = ["HeadSpec", "find_head", "ELEMENTWISE", "HeadNotFoundError"]

#: layers allowed between the head's linear layers: they act on each neuron separately, so they run on shards.
ELEMENTWISE: tuple[type[nn.Module], ...] = (
    nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.ELU, nn.SELU, nn.CELU, nn.GELU, nn.SiLU, nn.Mish, nn.Tanh, nn.Sigmoid,
    nn.Hardtanh, nn.Softplus, nn.Dropout, nn.AlphaDropout, nn.Identity,
)
#: layers that end the convolutional trunk.
TRUNK_END: tuple[type[nn.Module], ...] = (
    nn.modules.conv._ConvNd, nn.modules.pooling._MaxPoolNd, nn.modules.pooling._AvgPoolNd,
    nn.modules.pooling._AdaptiveAvgPoolNd, nn.modules.pooling._AdaptiveMaxPoolNd, nn.Flatten,
)


class HeadNotFoundError(ValueError):
    """The model has no fully-connected head this strategy can shard."""


@dataclass
class HeadSpec:
    """Where the head sits: ``parent`` is an ``nn.Sequential``; the head is its children from index ``start``
    (``start == 0`` and ``parent_name`` set: the whole submodule is the head)."""

    parent: nn.Sequential
    parent_name: str  # dotted path of ``parent`` in the model ("" = the model itself)
    start: int
    modules: list[tuple[str, nn.Module]]  # (child name in parent, module) of the head, in order

    @property
    def whole_parent(self) -> bool:
        return self.start == 0

    @property
    def linears(self) -> list[nn.Linear]:
        return [m for _, m in self.modules if isinstance(m, nn.Linear)]


def _check_head_modules(modules: list[tuple[str, nn.Module]], where: str) -> None:
    bad = [f"{n} ({type(m).__name__})" for n, m in modules if not isinstance(m, (nn.Linear, *ELEMENTWISE))]
    if bad:
        raise HeadNotFoundError(
            f"{where} contains layers the hybrid head cannot shard: {', '.join(bad)}; the head may only hold "
            "nn.Linear layers and element-wise activations/dropout. Name a different submodule with head=..."
        )
    if not any(isinstance(m, nn.Linear) for _, m in modules):
        raise HeadNotFoundError(f"{where} has no nn.Linear layer to shard; name the fully-connected head with head=...")


def find_head(model: nn.Module, head: str | None = None) -> HeadSpec:
    """Locate the fully-connected head of ``model`` (see the module docstring)."""
    if head is not None:
        try:
            sub = model.get_submodule(head)
        except AttributeError as e:
            names = [n for n, _ in model.named_children()]
            raise HeadNotFoundError(
                f"head={head!r}: the model has no such submodule (top-level children: {names})"
            ) from e
        if isinstance(sub, nn.Linear):
            parent_name, _, child = head.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            if not isinstance(parent, nn.Sequential) or list(parent._modules)[-1] != child:
                raise HeadNotFoundError(
                    f"head={head!r} is a single nn.Linear that is not the last layer of an nn.Sequential; wrap the "
                    "head in an nn.Sequential"
                )
            return HeadSpec(parent, parent_name, len(parent) - 1, [(child, sub)])
        if not isinstance(sub, nn.Sequential):
            raise HeadNotFoundError(
                f"head={head!r} is a {type(sub).__name__}; the hybrid head must be an nn.Sequential of linear and "
                "element-wise layers"
            )
        modules = list(sub.named_children())
        _check_head_modules(modules, f"head={head!r}")
        return HeadSpec(sub, head, 0, modules)

    # Layers, in registration order; leaves without parameters of their own that are neither trunk ends nor
    # element-wise (metrics, loss modules of a LightningModule) do not take part in the search.  Whether the
    # found head really is the trailing children of one nn.Sequential is checked structurally below.
    leaves = [
        (n, m)
        for n, m in model.named_modules()
        if n and not list(m.children())
        and (isinstance(m, (nn.Linear, *ELEMENTWISE, *TRUNK_END)) or any(True for _ in m.parameters(recurse=False)))
    ]
    last_trunk = max((i for i, (_, m) in enumerate(leaves) if isinstance(m, TRUNK_END)), default=None)
    if last_trunk is None:
        linears = [n for n, m in leaves if isinstance(m, nn.Linear)]
        raise HeadNotFoundError(
            f"strategy='hybrid_fc' searched the layers of {type(model).__name__} in registration order for a "
            "convolution, "
            f"pooling or flatten layer that ends a data-parallel trunk and found none (its nn.Linear layers: "
            f"{linears or 'none'}). A model that is only fully connected has no trunk to run data parallel, which is "
            "what this strategy pairs with the model-parallel head: use strategy='ddp' for it, or name the head "
            "with head='<dotted.path>' if the trunk is built from other layers"
        )
    tail = leaves[last_trunk + 1 :]
    if not tail:
        raise HeadNotFoundError(
            f"{type(model).__name__} ends with {type(leaves[last_trunk][1]).__name__}: no fully-connected head "
            "follows the last conv/pool/flatten; "
            "strategy='hybrid_fc' shards an nn.Linear head: give the model one (or name it with head='<submodule>'), "
            "or train a model without a fully-connected head with strategy='ddp'"
        )
    _check_head_modules(tail, f"the layers after {leaves[last_trunk][0]!r}")
    parent_names = {n.rpartition(".")[0] for n, _ in tail}
    if len(parent_names) != 1:
        raise HeadNotFoundError(
            f"the fully-connected layers after {leaves[last_trunk][0]!r} live in different submodules "
            f"({sorted(parent_names)}); "
            "put the head in one nn.Sequential or name it with head=..."
        )
    parent_name = parent_names.pop()
    parent = model.get_submodule(parent_name) if parent_name else model
    if not isinstance(parent, nn.Sequential):
        raise HeadNotFoundError(
            f"the head's layers sit in a {type(parent).__name__} ({parent_name or 'the model'}), not an "
            "nn.Sequential; name the head with head=..."
        )
    children = list(parent._modules)
    names = [n.rpartition(".")[2] for n, _ in tail]
    start = len(children) - len(names)
    if children[start:] != names:
        raise HeadNotFoundError(f"the head's layers {names} are not the last children of {parent_name or 'the model'}")
    return HeadSpec(parent, parent_name, start, [(c, parent._modules[c]) for c in names])  # type: ignore[misc]
