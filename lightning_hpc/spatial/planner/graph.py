"""The network as the planner sees it (Dryden et al., IPDPS 2019, sections V-B and V-C).

* :class:`Distribution`: how a layer's data is split, ``D = (n, h, w)`` parts of the sample, height and width
  dimensions (section V-A), and ``d`` parts of the depth of volumes (section I: the same method in 3-D).
* :func:`trace_layers`: every layer of the model (not only convolutions, section V-B) with its input and output
  shapes and its parents, traced with torch.fx and shape-propagated on the meta device.
* :func:`build_stages`: layers other than convolutions and linear layers inherit the distribution of their parent
  (section V-C), so the planner decides per *stage*, a convolution or linear layer with the layers that follow it.

Plain torch: no Lightning import.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import fx, nn
from torch.fx.passes.shape_prop import ShapeProp

from lightning_hpc.spatial.dispatch.windows import CONVOLUTIONS, TRANSPOSED, layer_windows

__all__ = ["Distribution", "LayerInfo", "Stage", "trace_layers", "build_stages"]


@dataclass(frozen=True, order=True)
class Distribution:
    """Parts of the sample (N), height (H) and width (W) dimensions, and of the depth (D) of volumes;
    ``n * d * h * w`` processes hold distinct data and ``replicas`` copies of that layout fill the rest of the
    world (only for layers too small to split).  A signal's length is its last dimension: split by ``w``."""

    n: int
    h: int
    w: int
    replicas: int = 1
    d: int = 1

    def parts(self, ndim: int) -> tuple[int, ...]:
        """The parts of the last ``ndim`` spatial dimensions: ``(w,)``, ``(h, w)`` or ``(d, h, w)``."""
        return (self.d, self.h, self.w)[3 - ndim :]

    @property
    def spatial_size(self) -> int:
        return self.d * self.h * self.w

    def label(self, ndim: int = 2) -> str:
        """``N2 x D1 x H2 x W1`` for a volume (``ndim`` 3), ``N2 x H2 x W1`` for an image, ``N2 x L2`` for a
        signal: every spatial dimension named, split or not."""
        names = {1: ("L",), 2: ("H", "W"), 3: ("D", "H", "W")}[ndim]
        text = " x ".join([f"N{self.n}", *(f"{k}{p}" for k, p in zip(names, self.parts(ndim)))])
        return text + (f" (x{self.replicas} replicated)" if self.replicas > 1 else "")

    def __str__(self) -> str:
        return self.label(3 if self.d > 1 else 2)


@dataclass
class LayerInfo:
    """One node of the traced network: its module (None for functions such as ``add``), shapes and parents."""

    name: str
    module: nn.Module | None
    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...]
    parents: list[str]

    @property
    def decides(self) -> bool:
        """Convolution (1-3-D, transposed too) and linear layers choose a distribution; the others inherit their
        parent's."""
        return isinstance(self.module, (*CONVOLUTIONS, *TRANSPOSED, nn.Linear))

    @property
    def spatial_ndim(self) -> int:
        """Spatial dimensions of the layer's input (0 for flat features)."""
        return max(len(self.in_shape) - 2, 0)

    @property
    def windows(self) -> tuple | None:
        """The input range each output range reads, per spatial dimension
        (:mod:`lightning_hpc.spatial.dispatch.windows`); None when the layer reads no neighbouring rows."""
        return layer_windows(self.module, self.in_shape, self.out_shape)

    @property
    def param_bytes(self) -> int:
        if self.module is None:
            return 0
        return sum(p.numel() * p.element_size() for p in self.module.parameters(recurse=False) if p.requires_grad)


@dataclass
class Stage:
    """A deciding layer and the layers that inherit its distribution."""

    name: str
    layers: list[LayerInfo]
    parents: list[str] = field(default_factory=list)
    #: bytes of the activation entering from each parent stage (what a shuffle would move)
    edge_bytes: dict[str, int] = field(default_factory=dict)

    @property
    def head(self) -> LayerInfo:
        return self.layers[0]


def trace_layers(model: nn.Module, input_shape: Sequence[int]) -> list[LayerInfo]:
    """Trace ``model`` with torch.fx and propagate shapes on the meta device (nothing is computed)."""
    meta_model = copy.deepcopy(model).to("meta").eval()  # eval: shapes only, BN needs no batch statistics
    gm = fx.symbolic_trace(meta_model)
    ShapeProp(gm).propagate(torch.empty(*input_shape, device="meta"))
    layers: list[LayerInfo] = []
    known: set[str] = set()
    shapes: dict[str, tuple[int, ...]] = {}
    for node in gm.graph.nodes:
        meta = node.meta.get("tensor_meta")
        out_shape = tuple(meta.shape) if meta is not None and hasattr(meta, "shape") else ()
        shapes[node.name] = out_shape
        if node.op in ("placeholder", "output", "get_attr"):
            continue
        parents = [p.name for p in node.all_input_nodes if p.name in known]
        first_input = node.all_input_nodes[0].name if node.all_input_nodes else None
        in_shape = shapes.get(first_input, tuple(input_shape)) if first_input else tuple(input_shape)
        module = model.get_submodule(node.target) if node.op == "call_module" else None
        name = str(node.target) if node.op == "call_module" else node.name
        layers.append(LayerInfo(name=name, module=module, in_shape=in_shape, out_shape=out_shape, parents=parents))
        known.add(node.name)
    # fx names call_module nodes by their path with "_" separators ("block1_0"); report the module path.
    rename = {n.name: (str(n.target) if n.op == "call_module" else n.name) for n in gm.graph.nodes}
    for layer in layers:
        layer.parents = [rename[p] for p in layer.parents]
    return layers


def build_stages(layers: list[LayerInfo]) -> list[Stage]:
    """Group layers into stages (a deciding layer + its followers); stages come in execution order."""
    stage_of: dict[str, str] = {}
    stages: dict[str, Stage] = {}
    by_name = {layer.name: layer for layer in layers}
    for layer in layers:
        if layer.decides or not layer.parents:
            stage = Stage(layer.name, [layer])
            stages[layer.name] = stage
            stage_of[layer.name] = layer.name
        else:
            stage_of[layer.name] = stage_of[layer.parents[0]]
            stage = stages[stage_of[layer.name]]
            stage.layers.append(layer)
        for parent in layer.parents:
            ps = stage_of[parent]
            if ps != stage.name and ps not in stage.parents:
                stage.parents.append(ps)
                shape = by_name[parent].out_shape
                stage.edge_bytes[ps] = 4 * math.prod(shape) if shape else 0
    # A join (residual add) sits in its first parent's stage, so creation order need not be topological.
    ordered: list[Stage] = []
    done: set[str] = set()
    pending = list(stages.values())
    while pending:
        ready = next((st for st in pending if all(p in done for p in st.parents)), None)
        if ready is None:
            raise ValueError("the layer graph has a cycle between stages; cannot plan it")
        ordered.append(ready)
        done.add(ready.name)
        pending.remove(ready)
    return ordered
