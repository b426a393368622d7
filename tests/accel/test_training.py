"""vitkit.accel.training beside optimize_for_training (tests/accel/test_swaps.py): contiguous parameters
(ContiguousParams), an optimizer over buffers that steps as one over the separate parameters, with the same
per-parameter state dict, and a trainer that uses it; and the CPU allocator's tuning."""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable

import pytest
import torch
from test_train import stopped_and_resumed, tiny, weights
from torch import nn

from vitkit.accel.training import ALIGN, ContiguousParams, cpu_allocator_tuned, tune_cpu_allocator
from vitkit.train import Trainer, config_from_dict, load_train_state, save_train_state
from vitkit.train.optim import build_optimizer


class Net(nn.Module):
    """Two layers, a frozen layer, a parameter the loss never reaches, a scalar parameter (odd sizes throughout)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(5, 7)
        self.frozen = nn.Linear(7, 7)
        self.frozen.requires_grad_(False)
        self.b = nn.Linear(7, 3)
        self.unused = nn.Parameter(torch.randn(4, 3))
        self.unused_bias = nn.Parameter(torch.randn(3))
        self.temperature = nn.Parameter(torch.tensor(1.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.frozen(self.a(x)))) * self.temperature


def groups(net: Net, decay: float = 0.1) -> list[dict]:
    """Decayed matrices, undecayed vectors (as vitkit's param_groups), the unused matrix among the decayed."""
    trainable = [(n, p) for n, p in net.named_parameters() if p.requires_grad]
    return [
        {"params": [p for _, p in trainable if p.ndim >= 2], "weight_decay": decay},
        {"params": [p for _, p in trainable if p.ndim < 2], "weight_decay": 0.0},
    ]


OPTIMIZERS: dict[str, Callable[[list[dict]], torch.optim.Optimizer]] = {
    "adamw-fused": lambda g: torch.optim.AdamW(g, lr=0.05, fused=True),
    "adam-foreach": lambda g: torch.optim.Adam(g, lr=0.05, foreach=True),
    "sgd-nesterov": lambda g: torch.optim.SGD(g, lr=0.05, momentum=0.9, nesterov=True),
}


def step(net: Net, opt: torch.optim.Optimizer, params: list[torch.Tensor], i: int, zero: Callable[[], None]) -> None:
    x = torch.randn(6, 5, generator=torch.Generator().manual_seed(i))
    net(x).square().mean().backward()
    nn.utils.clip_grad_norm_(params, 0.5)
    opt.step()
    zero()


def pair(name: str) -> tuple[Net, torch.optim.Optimizer, Net, torch.optim.Optimizer, ContiguousParams]:
    """(a net and its optimizer as they come, a copy and its optimizer laid out, the layout)."""
    ref = Net()
    net = copy.deepcopy(ref)
    ref_opt, opt = OPTIMIZERS[name](groups(ref, 0.0)), OPTIMIZERS[name](groups(net, 0.0))
    return ref, ref_opt, net, opt, ContiguousParams(opt)


def run(ref, ref_opt, net, opt, layout, steps: range) -> None:
    for i in steps:
        step(ref, ref_opt, list(ref.parameters()), i, lambda: ref_opt.zero_grad(set_to_none=True))
        step(net, opt, layout.params, i, layout.zero_grad)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_it_steps_as_the_optimizer_over_separate_parameters(name):
    ref, ref_opt, net, opt, layout = pair(name)
    assert len(layout.params) == 3  # a buffer per group, and the scalar on its own
    run(ref, ref_opt, net, opt, layout, range(12))
    for (n, p), q in zip(ref.named_parameters(), net.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=2e-6, atol=1e-6, msg=n)
    # never reached and not decayed: left as it was, exactly, with or without the layout
    assert torch.equal(net.unused, ref.unused) and torch.equal(net.unused, Net().unused)


def test_the_layout_is_views_into_one_aligned_buffer_per_group_dtype_and_device():
    net = Net()
    params = dict(net.named_parameters())
    before = {n: p.detach().clone() for n, p in params.items()}
    layout = ContiguousParams(torch.optim.AdamW(groups(net), lr=0.1, fused=True))
    assert dict(net.named_parameters()) == params  # the same parameter objects, the same values
    assert all(torch.equal(p, before[n]) for n, p in params.items())
    laid = {id(p): flat for flat, members in layout.members.items() for p, _ in members}
    # the scalar keeps its own tensor; the frozen layer is no optimizer's; the rest share two buffers
    assert set(laid) == {id(p) for n, p in params.items() if p.requires_grad and p.ndim}
    assert len(layout.members) == 2 and len(layout.params) == 3
    for flat, members in layout.members.items():
        for p, at in members:
            assert at.offset % ALIGN == 0
            assert p.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
            assert p.grad is not None and p.grad.untyped_storage().data_ptr() == flat.grad.untyped_storage().data_ptr()
            assert p.data_ptr() % 64 == 0
    assert params["temperature"].grad is None and params["frozen.weight"].grad is None


def test_the_unreached_decayed_parameter_decays_as_with_a_zero_gradient():
    """The documented difference from torch's optimizers, which skip a parameter without a gradient: as optax,
    a zero gradient, so AdamW's decoupled decay shrinks it by (1 - lr * wd) a step."""
    net = Net()
    opt = torch.optim.AdamW(groups(net, decay=0.1), lr=0.05, fused=True)
    layout = ContiguousParams(opt)
    start = net.unused.detach().clone()
    for i in range(3):
        step(net, opt, layout.params, i, layout.zero_grad)
    torch.testing.assert_close(net.unused, start * (1 - 0.05 * 0.1) ** 3, rtol=1e-6, atol=0)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_its_state_dict_is_the_per_parameter_one_and_loads_either_way(name):
    ref, ref_opt, net, opt, layout = pair(name)
    run(ref, ref_opt, net, opt, layout, range(3))
    ours, theirs = opt.state_dict(), ref_opt.state_dict()
    assert ours["param_groups"] == theirs["param_groups"]
    # the same entries, and the unreached parameters' (zero gradients here, none there) at zero
    order = [p for g in layout.groups for p in g]  # the per-parameter order the state dict numbers
    unreached = {i for i, p in enumerate(order) if p is net.unused or p is net.unused_bias}
    assert ours["state"].keys() - theirs["state"].keys() == unreached
    for i in unreached:
        assert all(not v.any() for k, v in ours["state"][i].items() if k != "step")
        del ours["state"][i]
    for i, entries in theirs["state"].items():
        assert ours["state"][i].keys() == entries.keys()
        for k, v in entries.items():
            if isinstance(v, torch.Tensor):
                assert ours["state"][i][k].shape == v.shape
                torch.testing.assert_close(ours["state"][i][k], v, rtol=2e-6, atol=1e-6)
            else:
                assert ours["state"][i][k] == v

    # crossed over: each optimizer continues from the other's state, and they still agree
    ref2, net2 = copy.deepcopy(net), copy.deepcopy(ref)
    ref2_opt, net2_opt = OPTIMIZERS[name](groups(ref2, 0.0)), OPTIMIZERS[name](groups(net2, 0.0))
    layout2 = ContiguousParams(net2_opt)
    ref2_opt.load_state_dict(copy.deepcopy(ours))  # as read back from a file: no tensor shared with `opt`
    net2_opt.load_state_dict(copy.deepcopy(theirs))
    run(ref, ref_opt, net, opt, layout, range(3, 6))
    run(ref2, ref2_opt, net2, net2_opt, layout2, range(3, 6))
    for a, b, c in zip(net.parameters(), ref2.parameters(), net2.parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=2e-6, atol=1e-6)
        torch.testing.assert_close(c, a, rtol=2e-6, atol=1e-6)


def test_a_state_without_an_unreached_parameter_loads_with_zero_moments():
    """An optimizer without the layout keeps no state for a parameter that never had a gradient."""
    ref, ref_opt, net, opt, layout = pair("adamw-fused")
    run(ref, ref_opt, net, opt, layout, range(2))
    saved = ref_opt.state_dict()
    unused = [p is ref.unused for g in ref_opt.param_groups for p in g["params"]].index(True)
    assert unused not in saved["state"]
    opt.load_state_dict(saved)
    flat = next(flat for flat, members in layout.members.items() if any(p is net.unused for p, _ in members))
    at = next(at for p, at in layout.members[flat] if p is net.unused)
    assert not at.view(opt.state[flat]["exp_avg"], net.unused.shape).any()
    assert opt.state[flat]["step"].item() == 2


def test_a_state_with_disagreeing_steps_does_not_load():
    ref, ref_opt, net, opt, layout = pair("adamw-fused")
    run(ref, ref_opt, net, opt, layout, range(2))
    saved = ref_opt.state_dict()
    saved["state"][1]["step"] = torch.tensor(7.0)
    with pytest.raises(ValueError, match="different 'step'"):
        opt.load_state_dict(saved)


def test_a_gradient_replaced_behind_its_back_is_an_error():
    net = Net()
    opt = torch.optim.AdamW(groups(net), lr=0.1, fused=True)
    layout = ContiguousParams(opt)
    net.zero_grad()  # set_to_none: the next backward makes new gradient tensors, which the optimizer never sees
    net(torch.randn(2, 5)).sum().backward()
    with pytest.raises(RuntimeError, match=r"shape \(4, 3\) no longer lies in the optimizer's buffer"):
        layout.zero_grad()


def test_it_is_laid_out_before_the_first_step_only():
    net = Net()
    opt = torch.optim.AdamW(groups(net), lr=0.1)
    net(torch.randn(2, 5)).sum().backward()
    opt.step()
    with pytest.raises(ValueError, match="before the optimizer's first step"):
        ContiguousParams(opt)


def tiny_run(tmp_path) -> dict:
    return tiny(tmp_path, run={"contiguous_params": True})


def test_the_trainer_lays_out_its_model_when_asked_and_saves_the_usual_state(tmp_path):
    off = Trainer(config_from_dict(tiny_run(tmp_path), ["run.name=off", "run.contiguous_params=false"]))
    off.close()
    assert off.layout is None and all(p.grad is None for p in off.model.parameters())
    t = Trainer(config_from_dict(tiny_run(tmp_path)))
    try:
        assert t.layout is not None
        trainable = [p for p in t.model.parameters() if p.requires_grad]
        laid = [p for members in t.layout.members.values() for p, _ in members]
        assert len(laid) == len(trainable) and len(t.layout.params) == 2  # decayed weights, the rest
        batches = t.batches(0)
        for _ in range(2):
            t.train_step(batches)
        save_train_state(tmp_path / "state.safetensors", t.model, t.optimizer, {"step": t.step})
        moments = [t.optimizer.state_dict()["state"][i]["exp_avg"].clone() for i in range(len(trainable))]
    finally:
        t.close()
    # an optimizer without the layout reads it: one state entry per parameter, the same moments
    model = copy.deepcopy(t.model)
    plain = build_optimizer(model, t.cfg.optim, fused=True)
    load_train_state(tmp_path / "state.safetensors", model, plain)
    params = [p for g in plain.param_groups for p in g["params"]]
    assert len(plain.state) == len(params) == len(trainable)
    assert all(plain.state[p]["step"].item() == 2 for p in params)
    assert all(torch.equal(plain.state[p]["exp_avg"], m) for p, m in zip(params, moments, strict=True))
    assert any(m.abs().sum() > 0 for m in moments)


def test_a_laid_out_run_resumes_exactly_with_or_without_the_layout(tmp_path):
    """The saved state is per parameter: a run stopped and resumed gives the uninterrupted run's weights bit for
    bit, and a resume that turns the layout off reads the same state."""
    doc = tiny_run(tmp_path)
    doc["schedule"] = {"steps": 6, "warmup_steps": 2}
    reference, resumed = stopped_and_resumed(doc)
    a, b = weights(reference.run_dir), weights(resumed.run_dir)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    plain = Trainer(config_from_dict(doc, ["run.name=cut", "run.resume=true", "run.contiguous_params=false"]))
    try:
        assert plain.layout is None and plain.step == 6
        assert len(plain.optimizer.state) == sum(p.requires_grad for p in plain.model.parameters())
    finally:
        plain.close()


def _proc_status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc tuning is Linux-only")
def test_tune_cpu_allocator_keeps_freed_tensor_memory_for_reuse():
    assert tune_cpu_allocator() and tune_cpu_allocator() and cpu_allocator_tuned()  # applied, and idempotent
    n = 64 * 2**20 // 4  # 64 MiB: above glibc's default mmap threshold (at most 32 MiB)
    grew = []  # the resident set's growth while each tensor lives: touched, then freed
    for _ in range(8):
        before = _proc_status_kib("VmRSS")
        t = torch.ones(n)
        grew.append(_proc_status_kib("VmRSS") - before)
        del t
    # with the default allocator each one is a fresh mapping, +64 MiB resident every time; kept, the same size is
    # served from the freed pages once the heap has settled (the first rounds may leave the freed block split by
    # small allocations made meanwhile)
    assert all(kib < 16 * 1024 for kib in grew[-3:]), grew
