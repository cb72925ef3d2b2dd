"""Every private Lightning / torch API lightning_hpc relies on, in one place, each behind a version check.

Public APIs cover almost everything we need; where they do not, the private name is used from here only, so an
upgrade that renames it fails in one place with a message naming the API and the versions it was checked on,
instead of with an AttributeError deep inside a training step.  Lightning is imported lazily inside the
functions that need it: the plain-torch cores import this module with Lightning absent.

Checked with torch 2.9-2.14 (the range pyproject.toml states) and lightning 2.2-2.6.
"""

from __future__ import annotations

import datetime
import importlib
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = [
    "CompatError",
    "flatten_dense_tensors",
    "unflatten_dense_tensors",
    "process_group_timeout",
    "ddp_ignore_parameters",
    "set_num_threads_if_needed",
    "optimizers_to_device",
    "automatic_optimizer_step_progress",
    "replace_hydra_subprocess_command",
    "replace_sigterm_notifier",
    "enable_torch_function",
    "disable_torch_function_subclass",
    "compiled_module_type",
    "outermost_compiled_modules",
    "compiled_backend",
    "graph_tracer",
    "tree_map",
    "tree_leaves",
    "untraced",
    "torch_function_modes",
    "torch_function_modes_suspended",
    "dynamo_error_type",
    "replace_metric_hooks",
    "all_gather_single",
    "reduce_scatter_single",
    "groups_made_unsplit",
    "foreach_copy_",
    "foreach_mul_",
    "foreach_add_",
    "foreach_norm",
    "weight_norm",
    "weight_norm_parametrization_type",
    "averaged_copy",
    "averaging_device",
    "put_whole_averages",
    "replace_lbfgs_flat_views",
]


class CompatError(RuntimeError):
    """A private API this package relies on is missing from the installed torch / Lightning."""


def _private(module: str, name: str) -> Any:
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise CompatError(
            f"{module}.{name} is not available in this installation ({exc}); lightning_hpc was checked with "
            "torch 2.9-2.14 and lightning 2.2-2.6: install a version in that range or report the upgrade"
        ) from exc


# ---- torch ---------------------------------------------------------------------------------------------------
def all_gather_single(output: torch.Tensor, input: torch.Tensor, group: Any = None, async_op: bool = False) -> Any:
    """``dist.all_gather_single`` where torch has it (2.13 does, 2.11 does not), else its older name
    ``all_gather_into_tensor``: the same collective, without a FutureWarning on new torch or an AttributeError
    on old."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(output, input, group=group, async_op=async_op)


def reduce_scatter_single(output: torch.Tensor, input: torch.Tensor, group: Any = None,
                          async_op: bool = False) -> Any:
    """``dist.reduce_scatter_single`` where torch has it, else ``reduce_scatter_tensor`` (its older name)."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(output, input, group=group, async_op=async_op)


@contextmanager
def groups_made_unsplit() -> Iterator[None]:
    """Inside, ``new_group`` makes each group's backend afresh instead of splitting it off the world's, where the
    world's backend claims to split but cannot.

    A world bound to a device (Lightning binds it to the rank's GPU) makes ``new_group`` split new groups off the
    world's backend, and the ranks outside a new group then call the backend's ``perform_nocolor_split``.  torch
    2.11's gloo backend reports ``supports_splitting`` but has no such method: every gloo group that leaves a rank
    out failed with an AttributeError on that rank (seen on a GPU with two ranks sharing it).  Unbinding the world
    while the groups are made gives them what an unbound world gives (each backend made from the store); the
    binding is restored after.  A backend that does split is left alone."""
    world = dist.group.WORLD if dist.is_initialized() else None
    device = getattr(world, "bound_device_id", None)
    backend = None
    if world is not None and device is not None:
        try:
            backend = world._get_backend(device)
        except RuntimeError:
            backend = None
    if backend is None or not getattr(backend, "supports_splitting", False) or hasattr(
        backend, "perform_nocolor_split"
    ):
        yield
        return
    world.bound_device_id = None  # type: ignore[union-attr]
    try:
        yield
    finally:
        world.bound_device_id = device  # type: ignore[union-attr]


def enable_torch_function() -> Any:
    """Context manager re-enabling ``__torch_function__`` dispatch for tensor subclasses inside a region that
    disabled it (``torch._C.DisableTorchFunctionSubclass``): user hooks called from there must see the
    subclass (the spatial ``SpatialTensor``)."""
    return _private("torch._C", "_EnableTorchFunction")()


def disable_torch_function_subclass() -> Any:
    """Context manager switching ``__torch_function__`` dispatch for tensor subclasses off
    (``torch._C.DisableTorchFunctionSubclass``, what ``torch.Tensor.__torch_function__`` itself runs the op
    under): a subclass's handler runs the op on the plain tensors inside it."""
    return _private("torch._C", "DisableTorchFunctionSubclass")()


def compiled_module_type() -> type:
    """The module type ``torch.compile(module)`` returns (``torch._dynamo.eval_frame.OptimizedModule``)."""
    return _private("torch._dynamo.eval_frame", "OptimizedModule")  # type: ignore[no-any-return]


def outermost_compiled_modules(module: Any) -> list[tuple[str, Any]]:
    """``(name, module)`` of each ``torch.compile``'d submodule of ``module`` (``""``: ``module`` itself) that is not
    inside another one (whose forward covers it); none where nothing was compiled in this process (the compiler is
    then not imported)."""
    if "torch._dynamo" not in sys.modules:
        return []
    found: list[tuple[str, Any]] = []
    for name, m in module.named_modules():
        if isinstance(m, compiled_module_type()) and not any(name.startswith(f"{o}.") for o, _ in found):
            found.append((name, m))
    return found


def compiled_backend(compiled: Any) -> Any:
    """The backend a ``torch.compile``'d module was compiled with (a name's compiler, or the user's callable), from
    the wrappers dynamo puts around it (``_torchdynamo_orig_backend`` at each level)."""
    fn = getattr(getattr(compiled, "dynamo_ctx", None), "callback", None)
    if fn is None:
        raise CompatError("torch.compile'd module without dynamo_ctx.callback: checked with torch 2.9-2.14")
    while hasattr(fn, "_torchdynamo_orig_backend"):
        fn = fn._torchdynamo_orig_backend
    return fn


def dynamo_error_type() -> type[Exception]:
    """The base class of dynamo's errors (a graph break under ``fullgraph=True``, an unsupported construct):
    ``torch._dynamo.exc.TorchDynamoException``."""
    return _private("torch._dynamo.exc", "TorchDynamoException")  # type: ignore[no-any-return]


def torch_function_modes() -> list[Any]:
    """The active ``TorchFunctionMode`` objects, outermost first
    (``torch.overrides._get_current_function_mode_stack``)."""
    return list(_private("torch.overrides", "_get_current_function_mode_stack")())


@contextmanager
def torch_function_modes_suspended() -> Iterator[list[Any]]:
    """Pop every active ``TorchFunctionMode`` for the block (yielded, outermost first) and push them back after it
    (``torch._C._pop_torch_function_stack`` / ``_push_on_torch_function_stack``)."""
    pop = _private("torch._C", "_pop_torch_function_stack")
    push = _private("torch._C", "_push_on_torch_function_stack")
    modes = []
    while torch_function_modes():
        modes.append(pop())
    modes.reverse()
    try:
        yield modes
    finally:
        for m in modes:
            push(m)


def untraced() -> Any:
    """Context manager hiding the ops of a block from a running ``make_fx`` trace (their results are constants of
    the graph): ``torch.fx.experimental.proxy_tensor.disable_proxy_modes_tracing``."""
    return _private("torch.fx.experimental.proxy_tensor", "disable_proxy_modes_tracing")()


def tree_map(fn: Callable[[Any], Any], tree: Any) -> Any:
    """``fn`` applied to every leaf of nested tuples, lists and dicts (``torch.utils._pytree.tree_map``)."""
    return _private("torch.utils._pytree", "tree_map")(fn, tree)


def tree_leaves(tree: Any) -> list[Any]:
    """The leaves of nested tuples, lists and dicts (``torch.utils._pytree.tree_leaves``)."""
    return list(_private("torch.utils._pytree", "tree_leaves")(tree))


def graph_tracer() -> Callable[..., Any]:
    """``make_fx``: records the aten ops a Python function runs (``torch.fx.experimental.proxy_tensor``)."""
    return _private("torch.fx.experimental.proxy_tensor", "make_fx")  # type: ignore[no-any-return]


def weight_norm_parametrization_type() -> type:
    """The parametrization ``torch.nn.utils.parametrizations.weight_norm`` registers (``_WeightNorm``)."""
    return _private("torch.nn.utils.parametrizations", "_WeightNorm")  # type: ignore[no-any-return]


def weight_norm(v: torch.Tensor, g: torch.Tensor, dim: int) -> torch.Tensor:
    """``g * v / ||v||`` over every dimension but ``dim``: the op ``weight_norm``'s parametrization computes
    (``torch._weight_norm``), so a weight rebuilt from ``g`` and ``v`` rounds as torch's does."""
    return _private("torch", "_weight_norm")(v, g, dim)  # type: ignore[no-any-return]


def averaged_copy(callback: Any) -> nn.Module | None:
    """The copy of the LightningModule a weight-averaging callback averages into, made in its ``setup`` (Lightning's
    private ``_average_model``: the copy itself for ``StochasticWeightAveraging``, an ``AveragedModel`` around it
    for ``WeightAveraging`` / ``EMAWeightAveraging``); None where the callback keeps none (yet)."""
    average = getattr(callback, "_average_model", None)
    if isinstance(average, torch.optim.swa_utils.AveragedModel):
        return average.module
    return average if isinstance(average, nn.Module) else None


def averaging_device(callback: Any) -> torch.device | None:
    """The device a weight-averaging callback was told to keep its averaged copy on (Lightning's private
    ``_device``: ``StochasticWeightAveraging``'s defaults to the host, ``WeightAveraging``'s to None, the module's
    device when its ``setup`` runs); None where none was given."""
    device = getattr(callback, "_device", None)
    return None if device is None else torch.device(device)


def put_whole_averages(checkpoint: dict[str, Any], averages: Sequence[tuple[Any, nn.Module]],
                       whole: Callable[[nn.Module], Any]) -> None:
    """Replace, in a checkpoint Lightning's weight-averaging callbacks wrote, their copies' ``state_dict()`` (this
    rank's part of a copy a strategy split) by ``whole(copy)``: ``StochasticWeightAveraging``'s
    ``average_model_state`` in its callback state, and the average ``WeightAveraging`` writes as the checkpoint's
    ``state_dict`` (the model's under ``current_model_state``).  ``averages``: (callback, its copy) pairs."""
    for callback, copy in averages:
        state = checkpoint.get("callbacks", {}).get(callback.state_key)
        if isinstance(state, dict) and state.get("average_model_state") is not None:
            state["average_model_state"] = whole(copy)
        elif "current_model_state" in checkpoint:
            checkpoint["state_dict"] = whole(copy)


def scaler_found_inf(scaler: Any, optimizer: Any) -> bool | None:
    """Whether ``scaler.unscale_(optimizer)`` found inf/nan in that optimizer's gradients this step (the verdict
    ``scaler.step`` acts on; ``torch.amp.GradScaler`` keeps it in its private ``_per_optimizer_states``); None where
    the scaler recorded none for it (not unscaled yet, or another torch that keeps it elsewhere)."""
    state = getattr(scaler, "_per_optimizer_states", {}).get(id(optimizer), {})
    per_device = state.get("found_inf_per_device") if isinstance(state, dict) else None
    if not per_device:
        return None
    return any(float(v) > 0 for v in per_device.values())


#: torch.optim.LBFGS's private methods every flat vector of its step goes through (the step itself, and
#: ``_directional_evaluate``, the strong-Wolfe line search's evaluation, calls both), and its parameter list
_LBFGS_FLAT = ("_gather_flat_grad", "_add_grad")


def replace_lbfgs_flat_views(
    optimizer: torch.optim.LBFGS,
    gather_flat_grad: Callable[[], torch.Tensor] | None,
    add_grad: Callable[[float, torch.Tensor], None] | None,
) -> None:
    """Make ``optimizer`` (a ``torch.optim.LBFGS``) build its flat gradient with ``gather_flat_grad()`` and add
    ``step_size * update`` (a flat vector) to its parameters with ``add_grad(step_size, update)``, in place of its
    private ``_gather_flat_grad`` / ``_add_grad`` (instance attributes shadow the methods).  ``None``: torch's own
    again, over the param group's current list of parameters (``_params``, the list the optimizer was built with,
    re-read: a rebind to other parameters replaced it) and their count (``_numel_cache``) recomputed.  Checked
    with torch 2.9-2.14: ``_gather_flat_grad()``, ``_add_grad(step_size, update)``, ``_directional_evaluate``
    (which calls both), ``_params`` and ``_numel_cache`` are in all of them."""
    needed = (*_LBFGS_FLAT, "_directional_evaluate", "_params", "_numel_cache")
    missing = [name for name in needed if not hasattr(optimizer, name)]
    if missing:
        raise CompatError(
            f"torch.optim.LBFGS has no {missing} in this torch; lightning_hpc was checked with torch 2.9-2.14: "
            "install a version in that range or report the upgrade"
        )
    if gather_flat_grad is None or add_grad is None:
        for name in _LBFGS_FLAT:
            optimizer.__dict__.pop(name, None)
        optimizer._params = optimizer.param_groups[0]["params"]  # type: ignore[attr-defined]
        optimizer._numel_cache = None  # type: ignore[attr-defined]
        return
    optimizer._gather_flat_grad = gather_flat_grad  # type: ignore[method-assign]
    optimizer._add_grad = add_grad  # type: ignore[method-assign, assignment]


def storage_use_count(t: torch.Tensor) -> int:
    """How many tensors (and storage objects) hold ``t``'s storage (torch has no public getter)."""
    return int(torch._C._storage_Use_Count(t.untyped_storage()._cdata))  # type: ignore[attr-defined]


def autograd_sequence_nr() -> int:
    """The sequence number the next autograd node made on this thread gets (torch has no public getter): nodes
    made between two readings were made by the ops run between them."""
    return int(torch._C._autograd._get_sequence_nr())  # type: ignore[attr-defined]


def default_store() -> Any:
    """The default process group's store (torch has no public getter)."""
    return dist.distributed_c10d._get_default_store()


def abort_process_groups() -> None:
    """Abort every process group of this process (torch's private registry of them), so that peers waiting on
    this rank fail at once instead of at a collective timeout where the backend's ``abort`` closes its
    connections (NCCL); gloo's closes nothing (torch 2.13: its peers are released when this process exits), and
    a backend without ``abort`` is left as it is."""
    world = _private("torch.distributed.distributed_c10d", "_world")
    for group in list(world.pg_names):
        try:
            group.abort()
        except Exception:  # noqa: BLE001 - such a group's peers fail when this process exits
            pass


def flatten_dense_tensors(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One contiguous 1-D buffer of ``tensors`` (torch's own bucketing helper, as DDP uses it)."""
    return _private("torch._utils", "_flatten_dense_tensors")(tensors)  # type: ignore[no-any-return]


def unflatten_dense_tensors(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Views of ``flat`` shaped like ``like`` (inverse of :func:`flatten_dense_tensors`)."""
    return _private("torch._utils", "_unflatten_dense_tensors")(flat, like)  # type: ignore[no-any-return]


def foreach_copy_(tensors: Sequence[torch.Tensor], sources: Sequence[torch.Tensor]) -> None:
    """``t.copy_(s)`` for every pair (cast to ``t``'s dtype), as one multi-tensor operation (none: nothing)."""
    if tensors:
        _private("torch", "_foreach_copy_")(list(tensors), list(sources))


def foreach_mul_(tensors: Sequence[torch.Tensor], factor: float | torch.Tensor) -> None:
    """Multiply every tensor by ``factor`` in place, as one multi-tensor operation (the kernels torch's optimizers
    use: on a GPU a few launches for all tensors, not one each)."""
    _private("torch", "_foreach_mul_")(list(tensors), factor)


def foreach_add_(tensors: Sequence[torch.Tensor], others: Sequence[torch.Tensor], alpha: float) -> None:
    """``t += alpha * o`` for every pair, in place, as one multi-tensor operation."""
    _private("torch", "_foreach_add_")(list(tensors), list(others), alpha=alpha)


def foreach_norm(tensors: Sequence[torch.Tensor], ord: float = 2.0) -> list[torch.Tensor]:
    """The ``ord``-norm of every tensor, as one multi-tensor reduction."""
    return list(_private("torch", "_foreach_norm")(list(tensors), ord))


def process_group_timeout(group: dist.ProcessGroup | None = None) -> datetime.timedelta | None:
    """The collective timeout a process group was created with (``None`` where the backend hides it).

    torch has no public getter: it is read from the group's backend options.
    """
    if not dist.is_initialized():
        return None
    pg = group if group is not None else dist.group.WORLD
    if pg is None:
        return None
    for device in getattr(pg, "_device_types", []) or []:
        try:
            timeout = pg._get_backend(device).options._timeout
        except Exception:  # a backend without readable options: keep looking, else unknown
            continue
        if isinstance(timeout, datetime.timedelta):
            return timeout
    return None


def ddp_ignore_parameters(module: nn.Module, names: Iterable[str]) -> None:
    """Tell ``DistributedDataParallel`` (built later on ``module``) not to reduce or broadcast these parameters
    and buffers (fully qualified names): they are sharded, or reduced by the strategy itself."""
    from torch.nn.parallel import DistributedDataParallel

    setter: Callable[[nn.Module, list[str]], None] | None = getattr(
        DistributedDataParallel, "_set_params_and_buffers_to_ignore_for_model", None
    )
    if setter is None:
        raise CompatError(
            "torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model is missing"
        )
    setter(module, list(names))


# ---- Lightning -----------------------------------------------------------------------------------------------
def set_num_threads_if_needed(num_processes: int) -> None:
    """Give each of ``num_processes`` ranks on a node its share of the cores, as Lightning's launchers do for
    DDP (``OMP_NUM_THREADS`` wins)."""
    _private("lightning.fabric.utilities.distributed", "_set_num_threads_if_needed")(num_processes=num_processes)


def optimizers_to_device(optimizers: Iterable[torch.optim.Optimizer], device: torch.device) -> None:
    """Move optimizer state tensors to ``device`` (Lightning's helper for restored checkpoints)."""
    _private("lightning.fabric.utilities.optimizer", "_optimizers_to_device")(optimizers, device)


def automatic_optimizer_step_progress(trainer: Any) -> Any:
    """The fit loop's optimizer-step progress counter under automatic optimization (``global_step`` is derived
    from it).  A strategy that defers an optimizer step (layered SGD's postponed update) adjusts it."""
    try:
        return trainer.fit_loop.epoch_loop.automatic_optimization.optim_progress.optimizer.step
    except AttributeError as exc:
        raise CompatError(
            "trainer.fit_loop.epoch_loop.automatic_optimization.optim_progress.optimizer.step is missing in this "
            "Lightning version; lightning_hpc was checked with lightning 2.2-2.6"
        ) from exc


def replace_hydra_subprocess_command(command: Callable[..., Any]) -> None:
    """Make Lightning's script launcher build the command of its child ranks under Hydra with ``command``
    (same signature as Lightning's ``_hydra_subprocess_cmd``).  Lightning has no public hook for it."""
    for name in (
        "lightning.fabric.strategies.launchers.subprocess_script",
        "lightning.pytorch.strategies.launchers.subprocess_script",
    ):
        module: Any = importlib.import_module(name)  # its private attribute is replaced below
        if not hasattr(module, "_hydra_subprocess_cmd"):
            raise CompatError(f"{name} has no _hydra_subprocess_cmd: this Lightning version changed its launcher")
        module._hydra_subprocess_cmd = command


def replace_sigterm_notifier(trainer: Any, make: Callable[[Any], Callable[[int, Any], None]]) -> bool:
    """Make ``trainer`` install ``make(connector)`` as its SIGTERM notifier in place of Lightning's
    ``_SignalConnector._sigterm_notifier_fn`` (an instance attribute shadows the method, and
    ``register_signal_handlers`` installs it); ``connector`` has ``trainer`` and ``received_sigterm``.  Lightning
    has no public hook for it.  Returns False when the notifier is already ``make``'s (a second setup)."""
    connector: Any = getattr(trainer, "_signal_connector", None)
    current = getattr(connector, "_sigterm_notifier_fn", None)
    if current is None or not hasattr(connector, "received_sigterm"):
        raise CompatError(
            "trainer._signal_connector._sigterm_notifier_fn is missing in this Lightning version; lightning_hpc was "
            "checked with lightning 2.2-2.6"
        )
    if getattr(current, "replaced_by", None) is make:
        return False
    notifier = make(connector)
    notifier.replaced_by = make  # type: ignore[attr-defined]
    connector._sigterm_notifier_fn = notifier
    return True


# ---- torchmetrics ----------------------------------------------------------------------------------------------
def stat_scores_base() -> type:
    """torchmetrics' private base of the stat-score metrics (accuracy, precision, recall, F-scores, ...)."""
    return _private("torchmetrics.classification.stat_scores", "_AbstractStatScores")  # type: ignore[no-any-return]


def replace_metric_hooks(wrap_update: Callable[..., Any], sync: Callable[..., Any]) -> dict[str, Any]:
    """Install ``wrap_update`` as torchmetrics' ``Metric._wrap_update`` (the private wrapper torchmetrics puts
    around a metric's ``update`` when it builds or restores one) and ``sync`` as ``Metric.sync``, class-wide; returns
    the replaced ones, ``{"_wrap_update": ..., "sync": ...}``, which a second call installs back.  Used by the
    spatial strategy's metric counting (``lightning_hpc.spatial.lightning.metrics``)."""
    metric = _private("torchmetrics", "Metric")
    if "_wrap_update" not in metric.__dict__ or "sync" not in metric.__dict__:
        raise CompatError(
            "torchmetrics.Metric has no _wrap_update / sync of its own in this installation; lightning_hpc was "
            "checked with torchmetrics 1.9: install it or report the upgrade"
        )
    previous = {"_wrap_update": metric.__dict__["_wrap_update"], "sync": metric.__dict__["sync"]}
    metric._wrap_update = wrap_update
    metric.sync = sync
    return previous


def forward_hooks(module: nn.Module) -> list[Callable[..., Any]]:
    """The forward hooks and forward pre-hooks registered on ``module`` (``nn.Module`` keeps them in private dicts)."""
    return [*module._forward_hooks.values(), *module._forward_pre_hooks.values()]


def backward_reaches(leaf: torch.Tensor) -> bool:
    """Inside a backward pass (from a tensor hook): whether this pass computes a gradient for the leaf tensor ``leaf``,
    i.e. runs its gradient accumulator: True under ``loss.backward()``, False under ``torch.autograd.grad(outputs,
    inputs)`` that leaves it out (a gradient penalty's pass). The engine's answer is private in torch."""
    node = torch.autograd.graph.get_gradient_edge(leaf).node
    return bool(torch._C._will_engine_execute_node(node))  # type: ignore[attr-defined]
