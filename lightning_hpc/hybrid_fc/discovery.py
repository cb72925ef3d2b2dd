"""Finding the fully-connected head of a model (Krizhevsky, section 3: conv layers hold ~95% of the compute,
the trailing fully-connected layers ~95% of the parameters).

Automatic: the head is the trailing run of ``nn.Linear`` layers, with the element-wise layers (activations,
dropout) between them, that follows the model's last convolution / pooling / flatten, in the order
``named_modules`` lists the leaves (the order of ``nn.Sequential`` models, and of models that define their
layers in forward order); the search runs over the whole LightningModule, so ``self.backbone`` +
``self.classifier`` works as well as ``self.model``.  A model with no convolution / pooling / flatten (a
fully-connected model, Lightning's ``BoringModel``, a transformer) has the trailing run of linear and
element-wise layers of its last layer's parent as its head; whatever comes before is the data-parallel trunk,
which may be empty (the head alone is then split over the ranks, each feeding it its own samples).  The head is
the trailing children of an ``nn.Sequential`` or, alone, one ``nn.Linear`` held by any module (``self.layer``,
``self.decoder``).  Named: ``head="model.classifier"`` (a dotted path from the searched module) takes that
submodule (an ``nn.Sequential`` of linear and element-wise layers, or one ``nn.Linear``).  Anything else is a
clear error before training starts, naming what was searched.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn
from torch.nn.utils import parametrize

from lightning_hpc.hybrid_fc.parametrized import parametrizations

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
    (``start == 0`` and ``parent_name`` set: the whole submodule is the head).  A lone ``nn.Linear`` head held by a
    module that is not an ``nn.Sequential`` is its own ``parent`` (``lone``), ``parent_name`` its dotted path."""

    parent: nn.Module
    parent_name: str  # dotted path of ``parent`` in the model ("" = the model itself)
    start: int
    modules: list[tuple[str, nn.Module]]  # (child name in parent, module) of the head, in order

    @property
    def whole_parent(self) -> bool:
        return self.start == 0

    @property
    def lone(self) -> bool:
        """The head is one ``nn.Linear`` that replaces itself in place (its holder is not an ``nn.Sequential``)."""
        return isinstance(self.parent, nn.Linear)

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
            if isinstance(parent, nn.Sequential):
                if list(parent._modules)[-1] != child:
                    raise HeadNotFoundError(
                        f"head={head!r} is an nn.Linear inside an nn.Sequential but not its last layer: the head must "
                        "end it (name the nn.Sequential holding the head's layers, or the last nn.Linear)"
                    )
                return HeadSpec(parent, parent_name, len(parent) - 1, [(child, sub)])
            return _lone(head, sub)
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
    # found head really is the trailing children of one nn.Sequential is checked structurally below.  A
    # parametrized layer (weight_norm(nn.Linear(...))) is one layer: its parametrization modules are not layers.
    inside = {id(p) for m in model.modules() if parametrize.is_parametrized(m)
              for chain in parametrizations(m).values() for p in chain.modules()}
    inside |= {id(m.parametrizations) for m in model.modules() if parametrize.is_parametrized(m)}
    leaves = [
        (n, m)
        for n, m in model.named_modules()
        if n and id(m) not in inside and all(id(c) in inside for c in m.children())
        and (isinstance(m, (nn.Linear, *ELEMENTWISE, *TRUNK_END)) or any(True for _ in m.parameters()))
    ]
    last_trunk = max((i for i, (_, m) in enumerate(leaves) if isinstance(m, TRUNK_END)), default=None)
    if last_trunk is None:
        return _trailing_head(model, leaves)
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
    if len(tail) == 1 and isinstance(tail[0][1], nn.Linear) and not isinstance(parent, nn.Sequential):
        return _lone(tail[0][0], tail[0][1])
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


def _lone(path: str, linear: nn.Linear) -> HeadSpec:
    """A head that is one ``nn.Linear`` at ``path``, held by a module that is not an ``nn.Sequential``."""
    return HeadSpec(linear, path, 0, [(path.rpartition(".")[2], linear)])


def _trailing_head(model: nn.Module, leaves: list[tuple[str, nn.Module]]) -> HeadSpec:
    """The head of a model without convolution / pooling / flatten: the trailing run of linear and element-wise
    layers of the last layer's parent (everything before it is the trunk, possibly empty)."""
    if not leaves or not isinstance(leaves[-1][1], (nn.Linear, *ELEMENTWISE)):
        last = f"ends with {leaves[-1][0]!r} ({type(leaves[-1][1]).__name__})" if leaves else "has no layer"
        raise HeadNotFoundError(
            f"strategy='hybrid_fc' searched the layers of {type(model).__name__} for a fully-connected head: it "
            f"{last}, not an nn.Linear. Name the head with head='<dotted.path>', or train the model with "
            "strategy='ddp'"
        )
    parent_name = leaves[-1][0].rpartition(".")[0]
    tail: list[tuple[str, nn.Module]] = []
    for name, m in reversed(leaves):
        if name.rpartition(".")[0] != parent_name or not isinstance(m, (nn.Linear, *ELEMENTWISE)):
            break
        tail.insert(0, (name, m))
    while tail and not isinstance(tail[0][1], nn.Linear) and len(tail) > 1:
        tail.pop(0)  # element-wise layers before the first linear layer stay in the trunk
    _check_head_modules(tail, f"the trailing layers of {parent_name or type(model).__name__}")
    parent = model.get_submodule(parent_name) if parent_name else model
    if not isinstance(parent, nn.Sequential):
        # a module's attributes, not a chain: its last linear layer is the head, whatever calls it
        path, final = [(n, m) for n, m in tail if isinstance(m, nn.Linear)][-1]
        assert isinstance(final, nn.Linear)
        return _lone(path, final)
    children = list(parent._modules)
    names = [n.rpartition(".")[2] for n, _ in tail]
    start = len(children) - len(names)
    if children[start:] != names:
        raise HeadNotFoundError(f"the head's layers {names} are not the last children of {parent_name or 'the model'}")
    return HeadSpec(parent, parent_name, start, [(c, parent._modules[c]) for c in names])
