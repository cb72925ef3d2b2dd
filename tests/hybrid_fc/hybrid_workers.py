"""Module-level worker functions for the hybrid-head tests (spawned ranks must be able to import them)."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from lightning_hpc.distributed.partition import block_bounds
from lightning_hpc.hybrid_fc import (
    HeadOptimizer,
    average_trunk_gradients,
    find_hybrid_head,
    full_optimizer_state,
    full_state_dict,
    head_parameters,
    parallelize_head,
    shard_optimizer_state,
)

B = 6  # examples per rank (uneven slices for K=4 in scheme c)
TRUNK_END = 4  # index of the first head layer in small_model()


def small_model(seed: int = 0) -> nn.Sequential:
    """Conv trunk + 3-layer head 64-24-18-10 (18 and 10 split unevenly over 4 ranks)."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(1),
        nn.Linear(64, 24),
        nn.ReLU(),
        nn.Linear(24, 18),
        nn.Tanh(),
        nn.Linear(18, 10),
    )


def batch(step: int, k: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(k * B, 2, 8, 8, generator=g, dtype=dtype)
    y = torch.randint(0, 10, (k * B,), generator=g)
    return x, y


def sgd(params) -> torch.optim.SGD:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-3)


HEAD_WEIGHT_SHAPES = [(24, 64), (18, 24), (10, 18)]  # full weights of small_model()'s head


class AllocationTracker(TorchDispatchMode):
    """Records the shape and storage size of every non-meta tensor produced by any op while active (factory
    functions such as ``empty`` included), so a test can tell whether a full-size head tensor ever existed."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: set[tuple[int, ...]] = set()
        self.max_storage_bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and not t.is_meta:
                self.shapes.add(tuple(t.shape))
                self.max_storage_bytes = max(self.max_storage_bytes, t.untyped_storage().nbytes())
        return out

    def full_head_shapes_seen(self) -> list[tuple[int, ...]]:
        return [s for s in HEAD_WEIGHT_SHAPES if s in self.shapes or s[::-1] in self.shapes]


def init_statistics(full: dict) -> dict:
    """Per head layer: max |w| / (1/sqrt(fan_in)) and std / (bound/sqrt(3)) of the gathered full weights."""
    out = {}
    for key, (o, i) in zip(("4.weight", "6.weight", "8.weight"), HEAD_WEIGHT_SHAPES):
        w, bound = full[key], 1.0 / i**0.5
        out[key] = (float(w.abs().max()) / bound, float(w.std()) / (bound / 3**0.5))
        b = full[key.replace("weight", "bias")]
        out[key.replace("weight", "bias")] = (float(b.abs().max()) / bound, 1.0)
    return out


def meta_built_hybrid(scheme: str, layouts, state: dict | None) -> tuple[nn.Module, dict]:
    """small_model() built on the meta device and parallelised (allocation tracked), then ``state`` loaded."""
    with torch.device("meta"):
        meta = small_model()
    with AllocationTracker() as tracker:
        hyb = parallelize_head(meta, scheme=scheme, layouts=layouts, device="cpu")
    head = head_parameters(hyb)
    info = {
        "full_head_shapes_seen": tracker.full_head_shapes_seen(),
        "max_storage_bytes": tracker.max_storage_bytes,
        "head_storage_bytes": sum(p.untyped_storage().nbytes() for p in head),
        "head_numel": sum(p.numel() for p in head),
        "init": init_statistics(full_state_dict(hyb)),
    }
    # control: building the same model for real inside the tracker must be seen (the tracker can fail)
    with AllocationTracker() as control:
        small_model()
    info["control_seen"] = control.full_head_shapes_seen()
    if state is not None:
        hyb.load_state_dict(state)
    return hyb, info


def per_step_equivalence(rank: int, k: int, scheme: str, layouts, steps: int, meta: bool = False) -> dict:
    """Hybrid (per_step) vs one process on the concatenated batch; returns max abs differences.

    ``meta``: the hybrid model is built on the meta device (only shards allocated) and the serial model's full
    state dict is loaded into the shards."""
    ref = small_model()
    worst: dict = {"logits": 0.0, "loss": 0.0, "params": 0.0, "input_grad": 0.0}
    if meta:
        hyb, worst["meta"] = meta_built_hybrid(scheme, layouts, ref.state_dict())
    else:
        hyb = parallelize_head(copy.deepcopy(ref), scheme=scheme, layouts=layouts)
    ref_opt, hyb_opt = sgd(ref.parameters()), sgd(hyb.parameters())
    for step in range(steps):
        x, y = batch(step, k)
        mine = slice(rank * B, (rank + 1) * B)
        xr = x[mine].clone().requires_grad_(True)
        logits = hyb(xr)
        loss = F.cross_entropy(logits, y[mine])
        hyb_opt.zero_grad()
        loss.backward()
        average_trunk_gradients(hyb)
        hyb_opt.step()
        x_ref = x.clone().requires_grad_(True)
        logits_ref = ref(x_ref)
        loss_ref = F.cross_entropy(logits_ref, y)
        ref_opt.zero_grad()
        loss_ref.backward()
        ref_opt.step()
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)
        worst["logits"] = max(worst["logits"], float((logits.detach() - logits_ref.detach()[mine]).abs().max()))
        worst["loss"] = max(worst["loss"], abs(float(global_loss) / k - float(loss_ref.detach())))
        # d(mean over K b)/dx_i = (1/K) d(local mean)/dx_i
        worst["input_grad"] = max(worst["input_grad"], float((xr.grad / k - x_ref.grad[mine]).abs().max()))
    full = full_state_dict(hyb)
    for key, value in ref.state_dict().items():
        worst["params"] = max(worst["params"], float((full[key] - value).abs().max()))
    # the shards gathered through another device than where they are kept (a weight-averaging copy on the host
    # beside a GPU model; here "cpu:0", which differs from the tensors' "cpu" as a device): the same tensors,
    # landing where they were kept
    via = full_state_dict(hyb, device=torch.device("cpu", 0))
    assert list(via) == list(full) and all(torch.equal(via[k], full[k]) and via[k].device == full[k].device
                                           for k in full)
    return worst


def run_meta_configs(rank: int, k: int, configs: list, steps: int) -> list[dict]:
    return [per_step_equivalence(rank, k, scheme, layouts, steps, meta=True) for scheme, layouts in configs]


def per_subbatch_equivalence(rank: int, k: int, scheme: str, layouts, steps: int) -> dict:
    """Hybrid (per_subbatch) vs a hand-written reference that updates the head after each of the K sub-batches."""
    ref = small_model()
    hyb = parallelize_head(copy.deepcopy(ref), scheme=scheme, fc_update="per_subbatch", layouts=layouts)
    hyb_opt = sgd(hyb.parameters())
    head_opt = HeadOptimizer(hyb_opt, head_parameters(hyb))
    head_module = find_hybrid_head(hyb)
    trunk, head = ref[:TRUNK_END], ref[TRUNK_END:]
    trunk_opt, ref_head_opt = sgd(trunk.parameters()), sgd(head.parameters())
    worst = {"logits": 0.0, "params": 0.0, "vs_per_step": 0.0}
    for step in range(steps):
        x, y = batch(step, k)
        mine = slice(rank * B, (rank + 1) * B)
        hyb_opt.zero_grad()
        with head_module.subbatch_update(y[mine], F.cross_entropy, head_opt.step):
            logits = hyb(x[mine])
            loss = F.cross_entropy(logits, y[mine])
        loss.backward()
        average_trunk_gradients(hyb)
        hyb_opt.step()

        # Reference, written out: trunk on all K x b examples, then K head steps on the sub-batches.
        acts = trunk(x)
        a_leaf = acts.detach().requires_grad_(True)
        grad_acts = torch.zeros_like(acts)
        logits_ref = torch.zeros(k * B, 10)
        for rows in reference_subbatches(scheme, k):
            ref_head_opt.zero_grad()
            a_j = a_leaf[rows].detach().requires_grad_(True)
            out = head(a_j)
            loss_j = F.cross_entropy(out, y[rows])  # mean over the sub-batch: its own SGD step
            loss_j.backward()
            grad_acts[rows] = a_j.grad * (len(rows) / (k * B))  # trunk sees the mean over all K x b
            logits_ref[rows] = out.detach()
            ref_head_opt.step()
        trunk_opt.zero_grad()
        acts.backward(grad_acts)
        trunk_opt.step()
        worst["logits"] = max(worst["logits"], float((logits.detach() - logits_ref[mine]).abs().max()))
    full = full_state_dict(hyb)
    per_step = serial_per_step_params(k, steps)
    for key, value in ref.state_dict().items():
        worst["params"] = max(worst["params"], float((full[key] - value).abs().max()))
        # how far the variable batch size moves the model from exact SGD (the test must be able to fail)
        worst["vs_per_step"] = max(worst["vs_per_step"], float((full[key] - per_step[key]).abs().max()))
    return worst


def reference_subbatches(scheme: str, k: int) -> list[torch.Tensor]:
    """Global row indices of each sub-batch, in processing order (schemes b and c)."""
    if scheme == "b":
        return [torch.arange(j * B, (j + 1) * B) for j in range(k)]
    out = []
    for a, b in block_bounds(B, k):
        out.append(torch.cat([torch.arange(r * B + a, r * B + b) for r in range(k)]))
    return out


def run_configs(rank: int, k: int, fn_name: str, configs: list, steps: int) -> list[dict]:
    """Run several (scheme, layouts) configurations in one process group (spawning is the slow part)."""
    fn = globals()[fn_name]
    return [fn(rank, k, scheme, layouts, steps) for scheme, layouts in configs]


def serial_per_step_params(k: int, steps: int) -> dict[str, torch.Tensor]:
    """Parameters of one process trained with plain SGD on the concatenated batches."""
    ref = small_model()
    opt = sgd(ref.parameters())
    for step in range(steps):
        x, y = batch(step, k)
        opt.zero_grad()
        F.cross_entropy(ref(x), y).backward()
        opt.step()
    return ref.state_dict()


def hybrid_sgd_step(model: nn.Module, opt: torch.optim.Optimizer, rank: int, k: int, step: int) -> None:
    """One plain-torch hybrid step: this rank's rows of ``batch(step, k)``, trunk gradients averaged, SGD."""
    x, y = batch(step, k)
    mine = slice(rank * B, (rank + 1) * B)
    opt.zero_grad()
    F.cross_entropy(model(x[mine]), y[mine]).backward()
    average_trunk_gradients(model)
    opt.step()


def memory_and_errors(rank: int, k: int) -> dict:
    """Head parameters and optimizer state held by this rank, and how far the logits of a batch smaller than
    scheme c's K slices (run as one sub-batch) are from the whole model's."""
    full = small_model()
    n_head_full = sum(p.numel() for p in full[TRUNK_END:].parameters())
    model = parallelize_head(small_model(), scheme="c")
    x2 = batch(0, k)[0][:2]  # 2 examples per rank cannot be cut into 4 slices
    with torch.no_grad():
        small_batch_diff = (model.eval()(x2) - full.eval()(x2)).abs().max().item()
    model.train()
    opt = sgd(model.parameters())
    hybrid_sgd_step(model, opt, rank, k, 0)
    head = head_parameters(model)
    head_ids = {id(p) for p in head}
    head_state = sum(
        v.numel() for p, s in opt.state.items() if id(p) in head_ids for v in s.values() if torch.is_tensor(v)
    )
    return {
        "head_local": sum(p.numel() for p in head),
        "head_state_local": head_state,
        "head_full": n_head_full,
        "shapes": [tuple(p.shape) for p in head],
        "small_batch_diff": small_batch_diff,
    }


def checkpoint_from_hybrid(rank: int, k: int, path: str, steps: int) -> dict:
    """Train ``steps`` steps on k ranks, save the full checkpoint, train one more step, return the result."""
    model = parallelize_head(small_model(), scheme="b")
    opt = sgd(model.parameters())
    for step in range(steps + 1):
        if step == steps:
            state = {"model": full_state_dict(model), "optimizer": full_optimizer_state(opt, model)}
            if rank == 0:
                torch.save(state, path)
            dist.barrier()
        hybrid_sgd_step(model, opt, rank, k, step)
    return _numpy(full_state_dict(model))


def checkpoint_into_hybrid(rank: int, k: int, path: str, step: int) -> dict:
    """Load a full (single-process) checkpoint on k ranks, check the shards, train one step, return the result."""
    state = torch.load(path)
    model = parallelize_head(small_model(seed=123), scheme="c")  # other init: everything must come from the file
    opt = sgd(model.parameters())
    model.load_state_dict(state["model"])
    opt.load_state_dict(shard_optimizer_state(state["optimizer"], opt, model))
    head_local = sum(p.numel() for p in head_parameters(model))
    hybrid_sgd_step(model, opt, rank, k, step)
    return {"state": _numpy(full_state_dict(model)), "head_local": head_local}


def serial_continue(path: str, k: int, step: int) -> tuple[dict, str]:
    """Load a full checkpoint into the plain model + optimizer, train one step, save a new full checkpoint."""
    state = torch.load(path)
    model = small_model(seed=321)
    opt = sgd(model.parameters())
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    x, y = batch(step, k)
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()
    out = path + ".serial"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, out)
    return _numpy(model.state_dict()), out


def _numpy(state: dict) -> dict:
    """Tensors leave a spawned rank as numpy copies (torch tensors would be shared through file descriptors that
    vanish when the rank exits)."""
    return {key: v.detach().cpu().numpy().copy() for key, v in state.items()}


#: K-FAC settings of the hybrid_fc + KFAC equivalence test (every step updates factors and decompositions)
KFAC_OPTIONS = dict(factor_update_freq=1, inv_update_freq=1, damping=0.01, kl_clip=0.01)


def serial_kfac_params(k: int, steps: int, skip_layers: str | None = None) -> dict[str, torch.Tensor]:
    """Serial reference of hybrid_fc + KFAC: one process, the concatenated batches, K-FAC on every layer (the
    sharded head is preconditioned as whole layers); ``skip_layers="Linear"``: the head left to the optimizer."""
    from lightning_hpc.kfac import KFACPreconditioner

    ref = small_model()
    opt = sgd(ref.parameters())
    pre = KFACPreconditioner(ref, optimizer=opt, skip_layers=skip_layers, announce=False, **KFAC_OPTIONS)
    for step in range(steps):
        x, y = batch(step, k)
        opt.zero_grad()
        F.cross_entropy(ref(x), y).backward()
        pre.step()
        opt.step()
    return ref.state_dict()


def split_head_recorder():
    """A callback recording, at the end of training (before the model is handed back whole), how many head
    parameters this rank held and their storage."""
    import lightning.pytorch as pl

    class SplitHead(pl.Callback):
        head_numel = head_storage_bytes = -1

        def on_train_end(self, trainer, pl_module) -> None:
            head = head_parameters(pl_module.model)  # raises if the head was not sharded
            self.head_numel = sum(p.numel() for p in head)
            self.head_storage_bytes = sum(p.untyped_storage().nbytes() for p in head)

    return SplitHead()


def lightning_equivalence(
    rank: int, k: int, scheme: str, fc_update: str, steps: int, ckpt_path: str, kfac: bool = False,
    layouts: list[str] | None = None,
) -> dict:
    """Train through Lightning's Trainer with HybridParallelStrategy (and the KFAC callback when ``kfac``; the head
    layers' ``layouts`` forced when given); return the full parameters afterwards."""
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_hpc import KFAC, HybridParallelStrategy, ImageClassifier
    from tests import fit_harness

    # This rank's share of each step's K x b examples (the sampler is disabled so the order is known).
    mine = slice(rank * B, (rank + 1) * B)
    xs = torch.cat([batch(s, k)[0][mine] for s in range(steps)])
    ys = torch.cat([batch(s, k)[1][mine] for s in range(steps)])
    loader = DataLoader(TensorDataset(xs, ys), batch_size=B, shuffle=False)
    module = ImageClassifier(small_model(), optimizer=sgd, num_classes=10)
    split = split_head_recorder()
    run = fit_harness.fit(
        module,
        loader,
        devices=k,
        strategy=HybridParallelStrategy(scheme=scheme, fc_update=fc_update, layouts=layouts),
        max_steps=steps,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        use_distributed_sampler=False,
        callbacks=[split, KFAC(**KFAC_OPTIONS)] if kfac else [split],
    )
    run.trainer.save_checkpoint(ckpt_path)  # after fit: the model and optimizer were handed back whole
    return {"state": _numpy(module.model.state_dict()), "head_local": split.head_numel}


def serial_sequence(k: int, steps: int, fc_update: str, scheme: str) -> dict:
    """Serial reference of ``lightning_equivalence``: step s trains on ``batch(s, k)``, rank r holding rows
    [r b, (r+1) b)."""
    if fc_update == "per_step":
        return _numpy(serial_per_step_params(k, steps))
    ref = small_model()
    trunk, head = ref[:TRUNK_END], ref[TRUNK_END:]
    trunk_opt, head_opt = sgd(trunk.parameters()), sgd(head.parameters())
    for s in range(steps):
        x, y = batch(s, k)
        acts = trunk(x)
        grad_acts = torch.zeros_like(acts)
        for rows in reference_subbatches(scheme, k):
            head_opt.zero_grad()
            a_j = acts[rows].detach().requires_grad_(True)
            F.cross_entropy(head(a_j), y[rows]).backward()
            grad_acts[rows] = a_j.grad * (len(rows) / (k * B))
            head_opt.step()
        trunk_opt.zero_grad()
        acts.backward(grad_acts)
        trunk_opt.step()
    return _numpy(ref.state_dict())


def lightning_meta_equivalence(rank: int, k: int, how: str, steps: int, init_path: str, ckpt_path: str) -> dict:
    """Trainer with HybridParallelStrategy on a model whose head is built on the meta device, either under
    ``trainer.init_module(empty_init=True)`` or in ``configure_model``.  Allocations are tracked from the setup
    hook to on_fit_start; at on_train_start the serial initial weights (``init_path``) are loaded into the shards."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_hpc import HybridParallelStrategy, ImageClassifier
    from tests import fit_harness

    class Tracking(pl.Callback):
        def setup(self, trainer, pl_module, stage):
            self.tracker = AllocationTracker()
            self.tracker.__enter__()

        def on_fit_start(self, trainer, pl_module):
            self.tracker.__exit__(None, None, None)

    class LoadInitial(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            pl_module.model.load_state_dict(torch.load(init_path, mmap=True))

    class BuiltInConfigureModel(ImageClassifier):
        def configure_model(self) -> None:
            if isinstance(self.model, nn.Identity):
                self.model = small_model()

    mine = slice(rank * B, (rank + 1) * B)
    xs = torch.cat([batch(s, k)[0][mine] for s in range(steps)])
    ys = torch.cat([batch(s, k)[1][mine] for s in range(steps)])
    loader = DataLoader(TensorDataset(xs, ys), batch_size=B, shuffle=False)
    tracking, split = Tracking(), split_head_recorder()
    trainer = fit_harness.trainer(
        devices=k,
        strategy=HybridParallelStrategy(scheme="c"),
        callbacks=[tracking, LoadInitial(), split],
        max_steps=steps,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        use_distributed_sampler=False,
    )
    if how == "init_module":
        with trainer.init_module(empty_init=True):
            module = ImageClassifier(small_model(), optimizer=sgd, num_classes=10)
        built_on_meta = all(p.is_meta for p in module.model[4:].parameters())
    else:
        module = BuiltInConfigureModel(nn.Identity(), optimizer=sgd, num_classes=10)
        built_on_meta = True  # checked below through the tracker: the head never had storage
    trainer.fit(module, train_dataloaders=loader)
    trainer.save_checkpoint(ckpt_path)
    return {
        "state": _numpy(module.model.state_dict()),  # handed back whole after fit
        "built_on_meta": built_on_meta,
        "full_head_shapes_seen": tracking.tracker.full_head_shapes_seen(),
        "max_storage_bytes": tracking.tracker.max_storage_bytes,
        "head_storage_bytes": split.head_storage_bytes,
        "head_numel": split.head_numel,
    }


def overlap_events(rank: int, k: int, scheme: str, overlap: bool) -> dict:
    """Order in which one training step issues its collectives (tagged by process group), waits for the forward
    exchanges and collects the reverse exchanges; plus whether exchange and head use different groups."""
    model = parallelize_head(small_model(), scheme=scheme, overlap=overlap)
    head = find_hybrid_head(model)
    ex = head.exchange
    events: list[tuple] = []

    def wrap(obj, name, tag):
        original = getattr(obj, name)

        def wrapped(*args, **kwargs):
            events.append((tag, name) if tag != "wait" else ("wait", args[0]))
            return original(*args, **kwargs)

        setattr(obj, name, wrapped)

    for name in ("all_gather", "reduce_scatter", "all_to_all", "broadcast", "reduce", "gather", "scatter_columns"):
        wrap(head.comm, name, "head")
        if head.xcomm is not head.comm:
            wrap(head.xcomm, name, "x")
    wrap(ex, "wait", "wait")
    wrap(ex, "collect_reverse", "collect")
    x, y = batch(0, k)
    mine = slice(rank * B, (rank + 1) * B)
    F.cross_entropy(model(x[mine]), y[mine]).backward()
    return {"events": events, "separate_groups": head.xcomm.group is not head.comm.group}


def checkpoint_from_hybrid_rank0(rank: int, k: int, path: str, steps: int) -> dict:
    """As :func:`checkpoint_from_hybrid`, saving as the strategy does (gathered to rank 0 into host memory) in
    buckets of 256 bytes (several messages per rank, some shards alone in a bucket)."""
    from lightning_hpc.distributed import state as state_module

    state_module.DEFAULT_BUCKET_BYTES = 256
    model = parallelize_head(small_model(), scheme="b")
    opt = sgd(model.parameters())
    shards = {}
    for step in range(steps + 1):
        if step == steps:
            state = {"model": full_state_dict(model, rank0_only=True, cpu=True),
                     "optimizer": full_optimizer_state(opt, model, rank0_only=True, cpu=True)}
            shards = {key: tuple(v.shape) for key, v in state["model"].items()}
            if rank == 0:
                assert all(v.device.type == "cpu" for v in state["model"].values())
                torch.save(state, path)
            dist.barrier()
        hybrid_sgd_step(model, opt, rank, k, step)
    return {"state": _numpy(full_state_dict(model)), "saved_shapes": shards}


# -- the model handed back after a stage: the user's module, whole, on every rank ------------------------------
def user_cnn(compiled: bool = False, dropout: bool = False) -> nn.Module:
    """A LightningModule as users write one: a conv trunk ``features`` and an ``nn.Sequential`` classifier head
    (``compiled``: the head ``torch.compile``'d, ``self.classifier = torch.compile(...)``, graph capture only;
    ``dropout``: a dropout between the head's two layers)."""
    import lightning.pytorch as pl

    class UserCNN(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.features = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(1))
            middle = [nn.ReLU(), nn.Dropout(0.5)] if dropout else [nn.ReLU()]
            self.classifier = nn.Sequential(nn.Linear(64, 24), *middle, nn.Linear(24, 10))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.classifier(self.features(x))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self(x), y)

        def test_step(self, batch, batch_idx):
            x, y = batch
            self.log("test_loss", F.cross_entropy(self(x), y), sync_dist=True)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    module = UserCNN().double()
    if compiled:
        module.classifier = torch.compile(module.classifier, backend="eager")
    return module


def serial_user_cnn(k: int, steps: int) -> dict[str, torch.Tensor]:
    """One process training ``user_cnn()`` on the K x b examples of each step (float64)."""
    model = user_cnn()
    opt = model.configure_optimizers()
    for s in range(steps):
        x, y = batch(s, k, torch.float64)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return model.state_dict()


def handed_back_cnn_in_eval_mode(rank: int, k: int, steps: int) -> dict:
    """``Trainer.fit`` of ``user_cnn()`` with ``strategy='hybrid_fc'`` and a callback that puts the model in eval
    mode when training ends (ready for inference, while the head is still split); after fit: every submodule's
    ``training`` flag by name, and (rank 0, with no process group left) the logits of a batch."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_hpc import HybridParallelStrategy
    from tests import fit_harness

    class EvalAtTrainEnd(pl.Callback):
        def on_train_end(self, trainer, pl_module) -> None:
            pl_module.eval()

    mine = slice(rank * B, (rank + 1) * B)
    xs = torch.cat([batch(s, k, torch.float64)[0][mine] for s in range(steps)])
    ys = torch.cat([batch(s, k, torch.float64)[1][mine] for s in range(steps)])
    loader = DataLoader(TensorDataset(xs, ys), batch_size=B, shuffle=False)
    module = user_cnn(dropout=True)
    trainer = fit_harness.trainer(
        devices=k, strategy=HybridParallelStrategy(), precision="64-true", max_steps=steps, num_sanity_val_steps=0,
        limit_val_batches=0, use_distributed_sampler=False, callbacks=[EvalAtTrainEnd()],
    )
    trainer.fit(module, train_dataloaders=loader)
    out: dict = {"modes": {name: m.training for name, m in module.named_modules()}}
    if rank != 0:
        return out
    dist.destroy_process_group()
    with torch.no_grad():
        out["logits"] = module(batch(steps, k, torch.float64)[0])
        out["state"] = {key: value.detach().clone() for key, value in module.state_dict().items()}
    return out


def handed_back_cnn(rank: int, k: int, steps: int, also_test: bool, compiled: bool = False) -> dict:
    """``Trainer.fit`` (then ``Trainer.test`` when ``also_test``) of ``user_cnn()`` with ``strategy='hybrid_fc'``;
    then, on this rank alone: the module's structure, a strict load of its state into a fresh instance, and
    (rank 0, after rank 1 has returned and with no process group left, so a collective raises) its forward."""
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_hpc import HybridParallelStrategy
    from tests import fit_harness

    mine = slice(rank * B, (rank + 1) * B)
    xs = torch.cat([batch(s, k, torch.float64)[0][mine] for s in range(steps)])
    ys = torch.cat([batch(s, k, torch.float64)[1][mine] for s in range(steps)])
    loader = DataLoader(TensorDataset(xs, ys), batch_size=B, shuffle=False)
    module = user_cnn(compiled)
    trainer = fit_harness.trainer(
        devices=k, strategy=HybridParallelStrategy(), precision="64-true", max_steps=steps, num_sanity_val_steps=0,
        limit_val_batches=0, use_distributed_sampler=False,
    )
    trainer.fit(module, train_dataloaders=loader)
    if also_test:
        trainer.test(module, dataloaders=loader, verbose=False)
    classifier = module.classifier._orig_mod if compiled else module.classifier
    out: dict = {
        "classifier_type": type(classifier).__name__,
        "last_layer": type(classifier[-1]).__name__,
        "state": {key.replace("_orig_mod.", ""): value.detach().clone() for key, value in module.state_dict().items()},
        "optimizer_shapes": [tuple(p.shape) for g in trainer.optimizers[0].param_groups for p in g["params"]],
        # the optimizer holds the module's own parameter objects (after fit, and after a later stage)
        "optimizer_holds_module_parameters": [id(p) for g in trainer.optimizers[0].param_groups for p in g["params"]]
        == [id(p) for p in module.parameters()],
    }
    fresh = user_cnn(compiled)
    fresh.load_state_dict(module.state_dict(), strict=True)
    if rank != 0:
        return out  # rank 1 is done: whatever rank 0 does next, it does alone
    dist.destroy_process_group()  # no process group: a collective in the forward raises instead of waiting
    x = batch(steps, k, torch.float64)[0]
    with torch.no_grad():
        out["logits"] = module(x)
        out["fresh_logits"] = fresh(x)
    return out


# -- LBFGS: the whole model's flat vectors on every rank -------------------------------------------------------
LBFGS_STEPS = 4  # two epochs of two batches
LBFGS_BATCHES = 2


def lbfgs_cnn(line_search: str | None, width: int, head_first: bool = False) -> nn.Module:
    """A LightningModule with a conv trunk and a 2-layer classifier head of ``width`` hidden units (odd widths
    split unevenly over 2 ranks), trained by ``torch.optim.LBFGS`` (3 iterations per step, float64);
    ``head_first``: over the head's parameters first (LBFGS keeps its state under its first parameter)."""
    import lightning.pytorch as pl

    class LBFGSCNN(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.features = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.Tanh(), nn.MaxPool2d(2), nn.Flatten(1))
            self.classifier = nn.Sequential(nn.Linear(64, width), nn.Tanh(), nn.Linear(width, 5))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.classifier(self.features(x))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self(x), y)

        def configure_optimizers(self):
            head = list(self.classifier.parameters())
            params = head + list(self.features.parameters()) if head_first else list(self.parameters())
            return torch.optim.LBFGS(params, lr=0.5, max_iter=3, history_size=4, line_search_fn=line_search)

    return LBFGSCNN().double()


def lbfgs_batch(step: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step`` (the epochs repeat their batches)."""
    g = torch.Generator().manual_seed(2000 + step % LBFGS_BATCHES)
    return torch.randn(k * B, 2, 8, 8, generator=g, dtype=torch.float64), torch.randint(0, 5, (k * B,), generator=g)


def serial_lbfgs(k: int, line_search: str | None, width: int, steps: int = LBFGS_STEPS,
                 head_first: bool = False) -> tuple[dict, dict]:
    """One process training ``lbfgs_cnn`` on the global batches: its state dict and its optimizer's."""
    from tests import lbfgs_reference

    model = lbfgs_cnn(line_search, width, head_first)
    opt = model.configure_optimizers()
    lbfgs_reference.train(model, opt, [lbfgs_batch(s, k) for s in range(steps)], F.cross_entropy)
    return model.state_dict(), opt.state_dict()


def hybrid_lbfgs(rank: int, k: int, line_search: str | None, width: int, ckpt_dir: str | None = None,
                 resume: str | None = None, head_first: bool = False) -> dict:
    """``Trainer.fit`` of ``lbfgs_cnn`` with ``strategy='hybrid_fc'``, each rank on its share of every global
    batch, for two epochs; ``ckpt_dir``: a checkpoint after the first epoch (written while the head is split);
    ``resume``: from that checkpoint.  Returns the module's whole state (handed back) and, from rank 0, what the
    checkpoint holds."""
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_hpc import HybridParallelStrategy
    from tests import fit_harness

    mine = slice(rank * B, (rank + 1) * B)
    batches = [lbfgs_batch(s, k) for s in range(LBFGS_BATCHES)]
    xs, ys = torch.cat([x[mine] for x, _ in batches]), torch.cat([y[mine] for _, y in batches])
    loader = DataLoader(TensorDataset(xs, ys), batch_size=B, shuffle=False)
    module = lbfgs_cnn(line_search, width, head_first)
    saving = {}
    if ckpt_dir is not None:
        saving = {"callbacks": [ModelCheckpoint(dirpath=ckpt_dir, filename="{epoch}", save_top_k=-1)],
                  "enable_checkpointing": True}
    trainer = fit_harness.trainer(
        devices=k, strategy=HybridParallelStrategy(), precision="64-true", max_epochs=2,
        num_sanity_val_steps=0, limit_val_batches=0, use_distributed_sampler=False, **saving,
    )
    trainer.fit(module, train_dataloaders=loader, ckpt_path=resume)
    return {"state": {key: value.detach().clone() for key, value in module.state_dict().items()},
            "steps": trainer.global_step,
            "optimizer_shapes": [tuple(p.shape) for g in trainer.optimizers[0].param_groups for p in g["params"]]}
