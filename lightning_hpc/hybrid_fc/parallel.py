"""Turning a model into the hybrid one: data-parallel trunk, model-parallel head (section 4), plus the trunk's
gradient averaging (section 4.1)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_hpc.distributed.gradients import allreduce_flat
from lightning_hpc.distributed.groups import group_timeout, new_group
from lightning_hpc.hybrid_fc.collectives import ByteCounter, allreduce_ring_bytes
from lightning_hpc.hybrid_fc.discovery import ELEMENTWISE, HeadSpec, find_head
from lightning_hpc.hybrid_fc.head import HybridHead
from lightning_hpc.hybrid_fc.parametrized import refuse_unsplittable
from lightning_hpc.hybrid_fc.sequential_view import IndexedLikeSequential
from lightning_hpc.hybrid_fc.sharded_linear import ShardedLinear
from lightning_hpc.hybrid_fc.twins import find_twins, trained_original

__all__ = [
    "parallelize_head",
    "unparallelize_head",
    "UserHead",
    "find_hybrid_head",
    "find_hybrid_heads",
    "head_parameters",
    "trunk_parameters",
    "average_trunk_gradients",
    "materialize_meta",
    "has_meta_head",
    "linear_layers_on_meta",
]


@contextlib.contextmanager
def linear_layers_on_meta() -> Iterator[None]:
    """Within this block every ``nn.Linear`` (and subclass) is created on the meta device, everything else as
    usual.  The head's layers then never get storage: :func:`parallelize_head` allocates only each rank's shard.
    ``HybridParallelStrategy.tensor_init_context`` (``Trainer.init_module``, ``LightningModule.configure_model``)
    uses this.  Linear layers outside the head are allocated later by :func:`materialize_meta` with their
    ``reset_parameters()`` (not with a custom initialisation the model's ``__init__`` applied to them)."""
    original = nn.Linear.__init__

    def init(
        self: nn.Linear, in_features: int, out_features: int, bias: bool = True, device: Any = None, dtype: Any = None
    ) -> None:
        original(self, in_features, out_features, bias, device="meta", dtype=dtype)

    nn.Linear.__init__ = init  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Linear.__init__ = original  # type: ignore[method-assign]


@dataclass
class UserHead:
    """The head as the user built it, kept while it is split so :func:`unparallelize_head` can put it back:
    ``container`` is the ``nn.Sequential`` the head's layers are children of (the whole head, or the model with
    the trunk in front), ``path`` its dotted place in the model given to :func:`parallelize_head` (``""``: that
    model itself), ``linears`` the head's ``nn.Linear`` layers in order.  While split, the linear layers live on
    the meta device (shape and type only: the shards hold the values, no rank keeps the full head).
    ``twin_of``: the path of the head's container when this is a frozen copy of it split alike (twins.py), else
    ``None``."""

    container: nn.Module
    path: str
    linears: list[nn.Linear]
    twin_of: str | None = None


class _TrunkThenHead(IndexedLikeSequential, nn.Module):
    """Replaces an ``nn.Sequential`` whose last children are the head: runs the trunk children, then the hybrid
    head.  Trunk children and the head's shards keep their original names and order, so ``state_dict`` keys are
    unchanged and indexing reads as the user's container (sequential_view.py)."""

    hybrid_head: HybridHead  # set in __init__ without registering it as a child

    def __init__(self, seq: nn.Sequential, start: int, head: HybridHead) -> None:
        super().__init__()
        names = list(seq._modules)
        self._trunk_names = names[:start]
        for n in self._trunk_names:
            self.add_module(n, seq._modules[n])
        for n, m in head.named_children():
            self.add_module(n, m)
        object.__setattr__(self, "hybrid_head", head)  # not registered twice: its children already are

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for n in self._trunk_names:
            x = self._modules[n](x)  # type: ignore[misc]
        return self.hybrid_head(x)

    def train(self, mode: bool = True) -> _TrunkThenHead:
        super().train(mode)
        self.hybrid_head.training = mode
        return self


class _LoneShard(ShardedLinear):
    """The shard of a head that is one ``nn.Linear`` held by a module that is not an ``nn.Sequential`` (Lightning's
    ``BoringModel.layer``, a transformer's ``decoder``): it takes the linear layer's place, so the module tree and
    the ``state_dict`` keys stay the user's.  A call from the model (the activations alone) runs the whole hybrid
    head (exchange, sharded product, logits back to their owners); the head's own calls (with the gradient scale)
    compute the shard, and module hooks (K-FAC's) fire on those only."""

    hybrid_head: HybridHead  # set by parallelize_head without registering it (it holds this shard)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and not kwargs:  # the model's call, where its nn.Linear was called
            return self.hybrid_head(args[0])
        return super().__call__(*args, **kwargs)

    def train(self, mode: bool = True) -> _LoneShard:
        super().train(mode)
        self.hybrid_head.training = mode
        return self


def _broadcast_head(spec: HeadSpec, group: Any) -> None:
    """Make the full head identical on every rank (rank 0's) before each rank keeps its shard."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    src = dist.get_global_rank(group, 0) if group is not None else 0
    for _, m in spec.modules:
        for p in m.parameters():
            dist.broadcast(p.data, src=src, group=group)


def has_meta_head(model: nn.Module, head: str | None = None) -> bool:
    """Whether the head's linear layers were built on the meta device (only their shards will be allocated)."""
    spec = find_head(model, head)
    metas = [p.is_meta for lin in spec.linears for p in lin.parameters()]
    if any(metas) and not all(metas):
        raise ValueError("the head's linear layers are partly on the meta device: build all of them on meta or none")
    return bool(metas) and all(metas)


@torch.no_grad()
def materialize_meta(module: nn.Module, device: torch.device | str, group: Any = None) -> list[str]:
    """Allocate every parameter/buffer still on the meta device on ``device``, initialise it with its module's
    ``reset_parameters()`` and make it identical on all ranks (broadcast from rank 0 of ``group``).

    For the parts of a meta-built model outside the head (the head's shards are allocated by
    :func:`parallelize_head`).  Returns the names of the materialised modules.  A module with meta tensors and no
    ``reset_parameters`` is an error: its initial values would be undefined.
    """
    done = []
    for name, m in module.named_modules():
        tensors = list(m.parameters(recurse=False)) + list(m.buffers(recurse=False))
        if not any(t.is_meta for t in tensors):
            continue
        if isinstance(m, ShardedLinear):
            continue
        reset = getattr(m, "reset_parameters", None)
        if not callable(reset):
            raise ValueError(
                f"{name or type(module).__name__} ({type(m).__name__}) was built on the meta device and has no "
                "reset_parameters(), "
                "so it cannot be initialised; build it on a real device (only the head needs the meta device)"
            )
        m.to_empty(device=device, recurse=False)
        reset()
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            src = dist.get_global_rank(group, 0) if group is not None else 0
            for t in list(m.parameters(recurse=False)) + list(m.buffers(recurse=False)):
                dist.broadcast(t.data, src=src, group=group)
        done.append(name)
    return done


def _same_ranks_group(group: Any) -> Any:
    """A second process group over the ranks of ``group`` (collective: every rank of the world calls it)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return None
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    return new_group(ranks, timeout=group_timeout(group))  # the same timeout as ``group``


def refuse_tied_head(model: nn.Module, head_modules: Sequence[tuple[str, nn.Module]], prefix: str) -> None:
    """A head layer's weight or bias that is also another layer's (tied weights, e.g. an output layer sharing an
    embedding's or another Linear's weight) cannot be split: the other layer would keep the whole tensor on every
    rank while the head trains one block of it per rank, and the two would no longer be one parameter.  Raised
    before anything is split, naming both places and the fix."""
    head_ids: dict[int, str] = {}
    for name, m in head_modules:
        if isinstance(m, nn.Linear):
            for pname, p in m.named_parameters():  # a weight_norm'ed layer's g and v are its parametrization's
                where = f"{prefix}.{name}.{pname}" if prefix else f"{name}.{pname}"
                other = head_ids.setdefault(id(p), where)
                if other != where:
                    _raise_tied(where, other)
    head_names = set(head_ids.values())
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in head_ids and name not in head_names:
            _raise_tied(head_ids[id(p)], name)


def _after_tied_layers(model: nn.Module, spec: HeadSpec) -> HeadSpec:
    """The automatically found head without its leading layers whose weight or bias is tied to a layer outside
    it: those stay in the data-parallel trunk (whole on every rank, reduced once by DDP, as on one process), the
    head starts after the last of them.  A head that would keep no linear layer is returned as found (and refused
    by :func:`refuse_tied_head`)."""
    if spec.lone:
        return spec
    prefix = f"{spec.parent_name}." if spec.parent_name else ""
    head_names = {prefix + name for name, _ in spec.modules}
    owners: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(p), []).append(n.rpartition(".")[0])
    # a parameter of the head is tied when another layer, in the head or outside it, holds it too
    shared = {pid for pid, names in owners.items() if len(names) > 1 and any(o in head_names for o in names)}
    tied = [i for i, (_, m) in enumerate(spec.modules) if any(id(p) in shared for p in m.parameters())]
    if not tied:
        return spec
    rest = spec.modules[tied[-1] + 1:]
    if not any(isinstance(m, nn.Linear) for _, m in rest):
        return spec
    assert isinstance(spec.parent, nn.Sequential)
    return HeadSpec(spec.parent, spec.parent_name, spec.start + tied[-1] + 1, rest)


def refuse_small_head(spec: HeadSpec, k: int) -> None:
    """Every head layer is split into K blocks of its input and of its output neurons (section 4: each rank owns
    1/K of every fully-connected layer), so a layer with fewer inputs or outputs than ranks cannot be split (a GAN
    discriminator's single logit, a binary classifier's).  Raised before anything is split, naming the layer."""
    prefix = f"{spec.parent_name}." if spec.parent_name and not spec.lone else ""
    for name, m in spec.modules:
        if isinstance(m, nn.Linear) and min(m.in_features, m.out_features) < k:
            where = spec.parent_name if spec.lone else prefix + name
            raise ValueError(
                f"strategy='hybrid_fc': the fully-connected head's layer {where!r} ({m.in_features} -> "
                f"{m.out_features}) is too small to split over {k} ranks: each rank owns a block of every head "
                f"layer's input and output neurons, so every head layer needs at least {k} of each. Name a head "
                "whose layers are that wide with head='<dotted.path>', run on at most "
                f"{min(m.in_features, m.out_features)} rank(s), or train with strategy='ddp'"
            )


def _raise_tied(head_name: str, other: str) -> None:
    raise ValueError(
        f"the fully-connected head's parameter {head_name!r} is tied to {other!r} (one tensor in both places): the "
        "head is split over the ranks, one block of each of its layers per rank, which a tied tensor cannot follow. "
        "Untie them (give the head its own copy: nn.Parameter(other.detach().clone()), a different model: the two "
        "then train apart), or train with strategy='ddp'"
    )


def parallelize_head(
    model: nn.Module,
    head: str | None = None,
    scheme: str = "c",
    fc_update: str = "per_step",
    group: Any = None,
    counter: ByteCounter | None = None,
    layouts: Sequence[str] | None = None,
    device: torch.device | str | None = None,
    head_init: Callable[[ShardedLinear], None] | None = None,
    overlap: bool = True,
) -> nn.Module:
    """Replace ``model``'s fully-connected head by a :class:`HybridHead` sharded over the ranks of ``group``.

    Returns the model (a new root module only when the model itself is the ``nn.Sequential`` holding the head).
    Every rank must call this with an identically structured model (it is collective).

    Materialised model: rank 0's head weights are broadcast, then each rank keeps its shard (peak memory: the
    full head once per rank).  Meta-device model (``with torch.device("meta"): model = ...``): each rank
    allocates only its 1/K shard of every head layer on ``device`` (default CPU), initialised by ``head_init`` or
    with ``nn.Linear``'s distribution (:meth:`ShardedLinear.reset_parameters`); any other meta tensor is
    allocated on ``device`` with its module's ``reset_parameters()`` and broadcast from rank 0
    (:func:`materialize_meta`).  No rank ever holds a full head layer; load trained weights afterwards with
    ``model.load_state_dict(full_state)`` (full tensors are sliced, ``torch.load(..., mmap=True)`` keeps them
    on disk until sliced).  ``overlap=False`` disables the overlap of the activation exchange with the head's
    computation (schemes.py), for measurements.
    """
    spec = find_head(model, head)
    if head is None:
        spec = _after_tied_layers(model, trained_original(model, spec))
    # the modules' names are children of parent_name, a lone linear's its own last component
    prefix = spec.parent_name.rpartition(".")[0] if spec.lone else spec.parent_name
    refuse_unsplittable(spec.modules, prefix)
    refuse_tied_head(model, spec.modules, prefix)
    refuse_small_head(spec, dist.get_world_size(group) if dist.is_initialized() else 1)
    meta = has_meta_head(model, head)
    twins = find_twins(model, spec)  # on the unsplit model: copies of the head's container (an EMA), split alike
    if not meta:
        _broadcast_head(spec, group)
    exchange_group = _same_ranks_group(group) if overlap else None
    model, hybrid = _split(model, spec, None, scheme=scheme, fc_update=fc_update, group=group, counter=counter,
                           layouts=layouts, exchange_group=exchange_group, device=device, head_init=head_init,
                           overlap=overlap)
    for twin in twins:
        refuse_tied_head(model, twin.modules, twin.parent_name.rpartition(".")[0] if twin.lone else twin.parent_name)
        _broadcast_head(twin, group)
        # the same blocks of the same layers as the head's (its layouts, group and exchange); a frozen copy is
        # never updated by a gradient, so it runs the per-step forward whatever the head's update mode
        model, _ = _split(model, twin, spec.parent_name, scheme=scheme, fc_update="per_step", group=group,
                          counter=counter, layouts=hybrid.layouts, exchange_group=exchange_group, device=device,
                          head_init=head_init, overlap=overlap)
    if meta:
        materialize_meta(model, device if device is not None else "cpu", group)
    return model


def _split(model: nn.Module, spec: HeadSpec, twin_of: str | None, **options: Any) -> tuple[nn.Module, HybridHead]:
    """Replace the head ``spec`` describes by a :class:`HybridHead` (``options``: its arguments); ``twin_of``: the
    head's container this one is a frozen copy of (its shards keep the copy's ``requires_grad``).  Returns the
    model (a new root when the model itself is the ``nn.Sequential`` holding the head) and the hybrid head."""
    before: list[nn.Module] = []
    linears: list[nn.Linear] = []
    between: list[list[nn.Module]] = []
    for _, m in spec.modules:
        if isinstance(m, nn.Linear):
            linears.append(m)
            between.append([])
        elif isinstance(m, ELEMENTWISE):
            (between[-1] if linears else before).append(m)
    names = {i: n for i, (n, _) in enumerate(spec.modules)}
    hybrid = HybridHead(
        linears,
        between,
        before,
        names,
        **options,
        shard_class=_LoneShard if spec.lone else ShardedLinear,
    )
    for lin in linears:
        lin.to("meta")  # the shards hold the values now: free the full layers, keep the user's modules
    hybrid.user_head = UserHead(spec.parent, spec.parent_name, linears, twin_of)
    if twin_of is not None:
        for lin, shard in zip(linears, hybrid.shards):
            for pname in shard.param_names:  # weight and bias, or weight_norm's g and v and the bias
                shard.get_parameter(pname).requires_grad_(lin.get_parameter(pname).requires_grad)
    if spec.lone:  # the shard takes the linear layer's place and runs the head when the model calls it
        shard = hybrid.shards[0]
        object.__setattr__(shard, "hybrid_head", hybrid)
        parent_name, _, attr = spec.parent_name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, attr, shard)
    elif spec.whole_parent and not spec.parent_name:  # the model is only its head: no trunk, a new root
        model = hybrid
    elif spec.whole_parent:
        parent_name, _, attr = spec.parent_name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, attr, hybrid)
    replacement: nn.Module = hybrid
    if not spec.lone and not spec.whole_parent:
        assert isinstance(spec.parent, nn.Sequential)  # a head after a trunk: the trailing children of one
        replacement = _TrunkThenHead(spec.parent, spec.start, hybrid)
        if not spec.parent_name:
            model = replacement
        else:
            parent_name, _, attr = spec.parent_name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, attr, replacement)
    # the container's mode, not nn.Module's default: a copy kept in eval mode (an EMA) stays so (Lightning keeps
    # each module's mode through fit); the user's children keep theirs
    for m in (hybrid, *hybrid.shards, replacement):
        m.training = spec.parent.training
    return model, hybrid


def unparallelize_head(model: nn.Module, cpu: bool = False,
                       device: torch.device | None = None) -> tuple[nn.Module, dict[int, nn.Parameter]]:
    """The inverse of :func:`parallelize_head`: the user's head container back in its place in ``model``, its
    ``nn.Linear`` layers holding the full trained weights (gathered from every rank's shards, on every rank:
    collective over the head's group; ``cpu``: gathered into host memory; ``device``: where the collectives run,
    for a model kept elsewhere, :func:`gather_shard_tensors`).  The trunk's modules were never
    replaced, so the whole model is the user's again: its ``state_dict`` loads strictly into the user's class and
    its forward runs on one rank alone.

    Returns the model (a new root when ``model`` itself was the ``nn.Sequential`` holding the head) and, for
    rebinding an optimizer, each shard parameter's replacement by ``id`` of the shard."""
    replaced: dict[int, nn.Parameter] = {}
    root = model
    # the copies first: the head's own container may be the root, which the last put-back replaces
    for hybrid in reversed(find_hybrid_heads(model)):
        root = _put_back(model, root, hybrid, cpu, replaced, device)
    return root, replaced


def _put_back(model: nn.Module, root: nn.Module, hybrid: HybridHead, cpu: bool,
              replaced: dict[int, nn.Parameter], device: torch.device | None = None) -> nn.Module:
    """One head of :func:`unparallelize_head`: its user's container back in its place (``root`` when that is the
    model itself); ``replaced`` gets each shard parameter's whole replacement."""
    user = hybrid.user_head
    if not isinstance(user, UserHead):
        raise ValueError("this hybrid head was not built by parallelize_head, so the user's head is not known")
    current = model.get_submodule(user.path) if user.path else model  # the HybridHead or the _TrunkThenHead
    for lin, shard, full in zip(user.linears, hybrid.shards, hybrid.gather_layers(cpu, device)):
        for pname, value in full.items():  # weight and bias, or weight_norm's g and v and the bias
            old = shard.get_parameter(pname)
            new = nn.Parameter(value, requires_grad=old.requires_grad)
            owner, _, attr = pname.rpartition(".")
            setattr(lin.get_submodule(owner) if owner else lin, attr, new)
            replaced[id(old)] = new
    user.container.train(current.training)
    if not user.path:
        return user.container
    parent_name, _, attr = user.path.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, attr, user.container)
    return root


def find_hybrid_heads(model: nn.Module) -> list[HybridHead]:
    """Every :class:`HybridHead` inside ``model``: the head first, then the frozen copies split alike (twins.py)."""
    heads: dict[int, HybridHead] = {}
    for m in model.modules():
        h = m.hybrid_head if isinstance(m, (_TrunkThenHead, _LoneShard)) else m  # held without registering it
        if isinstance(h, HybridHead):
            heads.setdefault(id(h), h)
    twin = [h for h in heads.values() if isinstance(h.user_head, UserHead) and h.user_head.twin_of is not None]
    return [h for h in heads.values() if h not in twin] + twin


def find_hybrid_head(model: nn.Module) -> HybridHead:
    """The :class:`HybridHead` of ``model``'s head, not of a copy split alike (raises if the model was not
    parallelised)."""
    heads = find_hybrid_heads(model)
    if not heads:
        raise ValueError("the model has no hybrid head; call parallelize_head(model) first")
    return heads[0]


def head_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The shards of every split head: the head's and those of its frozen copies (none of them is reduced by DDP,
    all are gathered whole into checkpoints and at hand-back)."""
    return [p for h in find_hybrid_heads(model) for s in h.shards for p in s.parameters()]


def trunk_parameters(model: nn.Module) -> Iterator[nn.Parameter]:
    head = {id(p) for p in head_parameters(model)}
    return (p for p in model.parameters() if id(p) not in head)


@torch.no_grad()
def average_trunk_gradients(model: nn.Module, group: Any = None, counter: ByteCounter | None = None) -> None:
    """Section 4.1: average the replicated trunk's gradients over the ranks (one flat all-reduce per dtype).

    (The Lightning strategy lets DistributedDataParallel do this, with the head's shards excluded.)"""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    k = dist.get_world_size(group)
    grads = [p.grad for p in trunk_parameters(model) if p.grad is not None]

    def count(flat: torch.Tensor) -> None:
        if counter is not None:
            counter.add("all_reduce", allreduce_ring_bytes(flat.numel(), flat.element_size(), k))

    allreduce_flat(grads, 1.0 / k, group=group, on_bucket=count)
