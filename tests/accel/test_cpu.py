"""vitkit.accel.cpu's oneDNN Dense layers: in training the function and gradients of F.linear (OneDnnLinear) and of
the MLP's GELU and second layer called apart (FusedMlp), in inference F.linear's function; where each applies, and
a ViT that optimize_for_training swapped them into, against the plain model's step."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from vitkit.accel import cpu, optimize_for_training
from vitkit.accel.cpu import (
    MIN_ROWS,
    MIN_SIDE,
    FusedMlp,
    OneDnnLinear,
    infers_onednn,
    linear,
    onednn_bf16,
    swap_for_training,
    uses_onednn,
)
from vitkit.accel.kernels import swap_gelus
from vitkit.models import VisionTransformer
from vitkit.models.flops import model_flops
from vitkit.models.vit import Mlp

pytestmark = pytest.mark.skipif(not cpu.has_onednn(), reason="oneDNN on x86 only")

# 32 images of 65 tokens: 2,080 rows a layer, from which the forward packs its weight (MIN_ROWS)
CFG = dict(img_size=32, patch_size=4, width=MIN_SIDE, depth=2, num_heads=2, mlp_dim=2 * MIN_SIDE, num_classes=5)
IMAGES = MIN_ROWS // 64


def operands(rows: int = MIN_ROWS, d_in: int = MIN_SIDE, d_out: int = 3 * MIN_SIDE, lead: int = 1):
    torch.manual_seed(0)
    x = torch.randn(lead, rows // lead, d_in, dtype=torch.float64)
    w = torch.randn(d_out, d_in, dtype=torch.float64) / d_in**0.5
    return x, w, torch.randn(d_out, dtype=torch.float64), torch.randn(lead, rows // lead, d_out, dtype=torch.float64)


def training_vit(**overrides) -> VisionTransformer:
    """A ViT as optimize_for_training gives it, its every Dense layer of MIN_SIDE (the head's 5 outputs aside)."""
    torch.manual_seed(0)
    return optimize_for_training(VisionTransformer(**{**CFG, **overrides}).train())


def fused_mlp(**kwargs) -> Mlp:
    """An Mlp as optimize_for_training swaps it: a FusedMlp of OneDnnLinear layers and a TanhGELU."""
    mlp = Mlp(MIN_SIDE, 2 * MIN_SIDE, **kwargs).train()
    swap_gelus(mlp)
    swap_for_training(mlp)
    assert type(mlp) is FusedMlp and type(mlp.fc1) is OneDnnLinear
    return mlp


class Tagged(torch.Tensor):
    """A tensor subclass that changes nothing (torch's default __torch_function__)."""


def count_onednn_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    matmul = cpu._matmul

    def counted(*args, **kwargs):
        calls.append(1)
        return matmul(*args, **kwargs)

    monkeypatch.setattr(cpu, "_matmul", counted)
    return calls


@pytest.mark.parametrize("rows, lead", [(MIN_ROWS, 1), (MIN_ROWS, 8), (197, 1), (32, 4)])  # packed, and not
def test_output_and_gradients_are_float64s_to_fp32_rounding(rows: int, lead: int, monkeypatch) -> None:
    calls = count_onednn_calls(monkeypatch)
    x64, w64, b64, g64 = operands(rows=rows, lead=lead)
    x, w, b = (t.float().requires_grad_() for t in (x64, w64, b64))
    y = linear(x, w, b)
    y.backward(g64.float())
    assert len(calls) == 2  # forward, and the input's gradient
    ref = [t.requires_grad_() for t in (x64.clone(), w64.clone(), b64.clone())]
    y64 = F.linear(*ref)
    y64.backward(g64)
    for got, want in [(y, y64), (x.grad, ref[0].grad), (w.grad, ref[1].grad), (b.grad, ref[2].grad)]:
        assert got.dtype == torch.float32 and got.shape == want.shape
        assert (got.double() - want).abs().max() <= 2e-6 * want.abs().max()


def test_a_non_contiguous_input_and_a_weight_slice(monkeypatch: pytest.MonkeyPatch) -> None:
    """As the first-token block calls it: rows of the qkv weight, an input that is a view."""
    calls = count_onednn_calls(monkeypatch)
    x64, w64, b64, _ = operands(rows=2 * MIN_ROWS, lead=4)
    x = x64.float().transpose(0, 1).requires_grad_()  # (rows/4, 4, in), not contiguous
    w = w64.float().requires_grad_()
    y = linear(x, w[MIN_SIDE:], None)
    y.sum().backward()
    assert calls and y.shape == (2 * MIN_ROWS // 4, 4, 2 * MIN_SIDE)
    assert (y.double() - F.linear(x64.transpose(0, 1), w64[MIN_SIDE:])).abs().max() < 1e-5
    assert w.grad[:MIN_SIDE].abs().max() == 0 and w.grad[MIN_SIDE:].abs().min() > 0


def test_a_gradient_of_the_gradient_is_f_linears() -> None:
    x64, w64, _, _ = operands()
    x, w = x64.float().requires_grad_(), w64.float().requires_grad_()
    x2, w2 = x64.float().requires_grad_(), w64.float().requires_grad_()
    (gx,) = torch.autograd.grad(linear(x, w).pow(2).sum(), x, create_graph=True)
    (gx2,) = torch.autograd.grad(F.linear(x2, w2).pow(2).sum(), x2, create_graph=True)
    (gw,) = torch.autograd.grad(gx.sum(), w)
    (gw2,) = torch.autograd.grad(gx2.sum(), w2)
    assert (gw - gw2).abs().max() <= 1e-5 * gw2.abs().max()


def test_where_it_applies() -> None:
    x64, w64, _, _ = operands()
    x, w = x64.float(), w64.float().requires_grad_()
    assert uses_onednn(x, w)
    assert uses_onednn(x[:, 1:], w) and uses_onednn(x[:, :1], w)  # fewer rows: the weight as it is, unpacked
    assert not uses_onednn(x[..., 1:], w[:, 1:])  # in_features below MIN_SIDE
    assert not uses_onednn(x, w[: MIN_SIDE - 1])  # out_features below MIN_SIDE
    assert not uses_onednn(x, w.detach())  # nothing records a gradient: inference
    with torch.no_grad():
        assert not uses_onednn(x, w)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # where oneDNN multiplies bf16
        assert uses_onednn(x, w) == uses_onednn(x.bfloat16(), w) == onednn_bf16()
        assert not uses_onednn(x[:, 1:], w)  # under autocast from MIN_ROWS only
    with torch.autocast("cpu", dtype=torch.float16):
        assert not uses_onednn(x, w)
    assert not uses_onednn(x, w.detach().as_subclass(Tagged).requires_grad_())  # a tensor subclass: its own ops
    assert not uses_onednn(x.double(), w.detach().double().requires_grad_())
    assert not uses_onednn(x.bfloat16(), w.detach().bfloat16().requires_grad_())


def test_a_swapped_layer_with_a_hook_runs_it_and_a_subclass_is_not_swapped(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = count_onednn_calls(monkeypatch)
    x = torch.randn(MIN_ROWS, MIN_SIDE)
    layer = nn.Linear(MIN_SIDE, MIN_SIDE)
    assert swap_for_training(layer) == 1 and type(layer) is OneDnnLinear
    y = layer(x)
    assert len(calls) == 1 and list(layer.state_dict()) == ["weight", "bias"]
    seen = []
    handle = layer.register_forward_hook(lambda m, args, out: seen.append(out.shape))
    assert torch.equal(layer(x), y)
    handle.remove()
    assert seen == [y.shape] and len(calls) == 2  # a module's call runs its hooks, whatever its forward

    class Scaled(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return 2 * super().forward(x)

    scaled = Scaled(MIN_SIDE, MIN_SIDE)
    assert swap_for_training(scaled) == 0 and type(scaled) is Scaled  # its own forward stays
    small = nn.Linear(MIN_SIDE, MIN_SIDE - 1)
    assert swap_for_training(small) == 0 and type(small) is nn.Linear


def test_the_plain_model_runs_torchs_layers(monkeypatch: pytest.MonkeyPatch) -> None:
    """A model as built is nn.Linear and nn.GELU throughout: the same step runs no vitkit matmul or fused MLP until
    optimize_for_training swaps them in."""
    calls = count_onednn_calls(monkeypatch)
    torch.manual_seed(0)
    model = VisionTransformer(**CFG).train()
    assert {type(m) for m in model.modules() if isinstance(m, (nn.Linear, Mlp))} == {nn.Linear, Mlp}
    model(torch.randn(IMAGES, 3, 32, 32)).sum().backward()
    assert not calls


def test_a_vit_step_through_onednn_equals_the_step_through_f_linear(monkeypatch: pytest.MonkeyPatch) -> None:
    """A model wide and long enough: the MLP, qkv (whole, and split for the first-token block) and projection
    layers multiply through oneDNN, and loss and every gradient are those of F.linear's path."""
    model = training_vit()
    images = torch.randn(IMAGES, 3, 32, 32)  # 32 images of 65 tokens: 2,080 rows
    labels = torch.randint(0, 5, (images.shape[0],))

    def step() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(images), labels)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    packed: list[bool] = []
    matmul = cpu._matmul
    monkeypatch.setattr(cpu, "_matmul", lambda *args, pack=True: packed.append(pack) or matmul(*args, pack=pack))
    loss, grads = step()
    # block 0: qkv, proj, fc1, fc2 (2,080 rows); block 1 (first token only): keys and values (2,080 rows), query,
    # projection, fc1 and fc2 (one row an image: 32); each forward and for the input's gradient, and only the
    # forwards of 2,048 rows or more pack their weight first
    assert len(packed) == 2 * 9 and sum(packed) == 5
    monkeypatch.setattr(cpu, "uses_onednn", lambda x, weight: False)
    loss_ref, grads_ref = step()
    assert len(packed) == 18
    assert abs(loss - loss_ref) < 1e-6
    for name, g in grads_ref.items():
        assert (grads[name] - g).abs().max() <= 1e-5 * max(g.abs().max().item(), 1e-6), name


@pytest.mark.onednn_bf16
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_under_bf16_autocast_bit_for_bit_autocasts_f_linear(x_dtype: torch.dtype, monkeypatch) -> None:
    """The bias added inside oneDNN's matmul rounds once, as autocast's addmm does: the same bits, output and every
    gradient in the dtype autocast gives them."""
    calls = count_onednn_calls(monkeypatch)
    x64, w64, b64, g64 = operands(lead=4)
    results = []
    for f in (F.linear, linear):
        x, w, b = x64.to(x_dtype).requires_grad_(), w64.float().requires_grad_(), b64.float().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = f(x, w, b)
        y.backward(g64.bfloat16())
        results.append((y, x.grad, w.grad, b.grad))
    assert len(calls) == 1
    for want, got in zip(*results):
        assert got.dtype == want.dtype and torch.equal(got, want)
    x = x64.float().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = linear(x, w64.float().requires_grad_())
    (gx,) = torch.autograd.grad(y.float().pow(2).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        gx.sum().backward()  # as the bf16 GELU kernel: a gradient of the gradient is refused, not wrong


def test_a_compiled_model_traces_f_linear_in_one_graph(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.compile sees plain F.linear (inductor picks its own kernels), and the checks themselves, and the
    first-token patch's switch, break no graph."""
    calls = count_onednn_calls(monkeypatch)
    model = training_vit()
    images = torch.randn(IMAGES, 3, 32, 32)
    torch.compile(model, backend="eager", fullgraph=True)(images).sum().backward()
    assert not calls
    model(images).sum().backward()  # the same call eagerly does run them
    assert len(calls) == 18  # 9 layers (see the test above), forward and input gradient


def mlp_step(model: nn.Module, autocast: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
    """Loss, every gradient, and the bytes autograd keeps for the backward pass (each storage once)."""
    torch.manual_seed(1)
    images, labels = torch.randn(IMAGES, 3, 32, 32), torch.randint(0, 5, (IMAGES,))
    storages: dict[int, int] = {}

    def keep(t: torch.Tensor) -> torch.Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    model.zero_grad(set_to_none=True)
    with (
        torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t),
        torch.autocast("cpu", torch.bfloat16, enabled=autocast),
    ):
        loss = F.cross_entropy(model(images), labels)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, sum(storages.values())


@pytest.mark.parametrize(
    "autocast", [False, pytest.param(True, marks=pytest.mark.onednn_bf16)], ids=["fp32", "bf16-autocast"]
)
def test_the_mlp_recomputes_its_gelu_for_the_backward_pass_with_the_same_gradients(autocast: bool) -> None:
    """In training the MLP's second layer and its GELU run as one function that keeps the GELU's input alone: the
    loss and every gradient bit for bit those of the two called apart, and one hidden activation less kept."""
    # 32 images of 65 tokens: 2,080 rows, 1.06M fp32 hidden activations (the fp32 kernels' threshold is 2^20)
    model = training_vit(mlp_dim=4 * MIN_SIDE)
    loss, grads, kept = mlp_step(model, autocast)
    for mlp in (m for m in model.modules() if isinstance(m, Mlp)):
        mlp.act.register_forward_hook(lambda *args: None)  # a hook: the GELU's call is made, and the two stay apart
    loss_apart, grads_apart, kept_apart = mlp_step(model, autocast)
    assert torch.equal(loss, loss_apart)
    for name, g in grads_apart.items():
        assert torch.equal(grads[name], g), name
    # block 0's GELU output (block 1 computes the class token alone: 32 rows, below oneDNN's and the kernels' sizes)
    assert kept_apart - kept == IMAGES * 65 * 4 * MIN_SIDE * (2 if autocast else 4)


@pytest.mark.onednn_bf16
def test_where_the_gelu_and_the_layer_stay_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    fused: list[int] = []
    apply = cpu._GeluLinear.apply
    monkeypatch.setattr(cpu._GeluLinear, "apply", lambda *args: fused.append(1) or apply(*args))
    x = torch.randn(4, MIN_ROWS // 4, MIN_SIDE, requires_grad=True)

    def runs_fused(mlp: Mlp, x: torch.Tensor = x, autocast: bool = True) -> bool:
        fused.clear()
        with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
            mlp(x).float().sum().backward()
        return bool(fused)

    assert runs_fused(fused_mlp())
    assert not runs_fused(fused_mlp().eval())  # eval mode: the GELU runs ATen's kernel
    assert not runs_fused(fused_mlp(drop=0.1))  # dropout between the GELU and fc2
    assert not runs_fused(fused_mlp(gelu="exact"))
    assert not runs_fused(fused_mlp(), x[:, : MIN_ROWS // 8])  # fewer rows than oneDNN's threshold
    assert not runs_fused(fused_mlp(), autocast=False)  # fp32, below the fp32 kernels' size
    for part in ("act", "fc2", "drop"):
        hooked = fused_mlp()
        getattr(hooked, part).register_forward_pre_hook(lambda *args: None)
        assert not runs_fused(hooked), part


def count_applies(monkeypatch: pytest.MonkeyPatch, function: type[torch.autograd.Function]) -> list[int]:
    calls: list[int] = []
    apply = function.apply
    monkeypatch.setattr(function, "apply", lambda *args: calls.append(1) or apply(*args))
    return calls


def penalty_grads(model: nn.Module, images: torch.Tensor, labels: torch.Tensor) -> list[torch.Tensor]:
    """A gradient penalty's gradients: the squared norm of the loss's gradient with respect to the images, a
    gradient of the gradient for every parameter."""
    images = images.detach().requires_grad_()
    (gx,) = torch.autograd.grad(F.cross_entropy(model(images), labels), images, create_graph=True)
    return [g.double() for g in torch.autograd.grad(gx.pow(2).sum(), list(model.parameters()))]


def test_in_fp32_a_gradient_of_the_gradient_through_the_fused_mlp_is_float64s(monkeypatch) -> None:
    """The MLP's fused GELU and second layer, the oneDNN layers and the first-token block in a backward pass that
    builds a graph: every parameter's gradient of a gradient penalty is the float64 plain model's to fp32 rounding.
    Attention written out: torch's fused CPU kernel (SDPA) has no gradient of its gradient."""
    fused = count_applies(monkeypatch, cpu._GeluLinear)
    onednn = count_applies(monkeypatch, cpu._OneDnnLinear)
    torch.manual_seed(0)
    plain = VisionTransformer(**{**CFG, "mlp_dim": 4 * MIN_SIDE, "attn_impl": "explicit"}).train()
    with torch.no_grad():
        plain.head.weight.normal_(std=0.1)
    model = optimize_for_training(copy.deepcopy(plain))
    last: list[tuple[int, ...]] = []
    model.blocks[-1].mlp.fc1.register_forward_hook(lambda m, args, out: last.append(tuple(args[0].shape)))
    images, labels = torch.randn(IMAGES, 3, 32, 32), torch.arange(IMAGES) % 5
    ours = penalty_grads(model, images, labels)
    assert fused and onednn and last == [(IMAGES, 1, MIN_SIDE)]  # block 0's fused MLP, block 1 the class token
    wide = penalty_grads(plain.double(), images.double(), labels)
    for (name, _), a, b in zip(model.named_parameters(), ours, wide, strict=True):
        assert (a - b).abs().max() <= 1e-5 * b.abs().max(), name  # 1.5e-6 at most here


@pytest.mark.onednn_bf16
def test_under_bf16_autocast_the_fused_mlp_refuses_a_gradient_of_the_gradient() -> None:
    """There the backward pass reads the weight's bf16 copy, which autograd cannot trace to the parameter: a
    gradient of the gradient would miss the weight's part, so it is refused rather than wrong."""
    mlp = fused_mlp()
    x = torch.randn(4, MIN_ROWS // 4, MIN_SIDE, requires_grad=True)
    with torch.autocast("cpu", torch.bfloat16):
        y = mlp(x)
    assert type(y.grad_fn).__name__ == "_GeluLinearBackward"
    (gx,) = torch.autograd.grad(y.float().pow(2).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        gx.sum().backward()


# ------------------------------------------------------------------------------------------------- inference
@pytest.mark.parametrize("rows, lead", [(1, 1), (197, 1), (197, 8), (MIN_ROWS, 1)])
def test_in_inference_a_layer_is_one_onednn_matmul(rows: int, lead: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """fp32: float64's result to fp32 rounding (oneDNN's summation, not MKL's); bf16: F.linear's bits (nn.Linear
    runs oneDNN's matmul there too, the bias rounded in once either way)."""
    calls = count_onednn_calls(monkeypatch)
    x64, w64, b64, _ = operands(rows=rows * lead, lead=lead)
    w, b = w64.float().requires_grad_(), b64.float().requires_grad_()  # parameters: no_grad makes it inference
    with torch.no_grad():
        y = linear(x64.float(), w, b)
        yb = linear(x64.bfloat16(), w.bfloat16(), b.bfloat16())
        yb_none = linear(x64.bfloat16(), w.bfloat16())
        assert len(calls) == (3 if onednn_bf16() else 1)  # bf16: F.linear where oneDNN multiplies no bf16
        assert torch.equal(yb, F.linear(x64.bfloat16(), w.bfloat16(), b.bfloat16()))
        assert torch.equal(yb_none, F.linear(x64.bfloat16(), w.bfloat16()))
    want = F.linear(x64, w64, b64)
    assert y.dtype == torch.float32 and y.shape == want.shape
    assert (y.double() - want).abs().max() <= 2e-6 * want.abs().max()


def test_where_inference_runs_onednn() -> None:
    x64, w64, b64, _ = operands(rows=197)
    x, w, b = x64.float(), w64.float().requires_grad_(), b64.float().requires_grad_()
    with torch.no_grad():
        assert infers_onednn(x, w, b) and infers_onednn(x, w, None)
        assert infers_onednn(x.bfloat16(), w.bfloat16(), b.bfloat16()) == onednn_bf16()
        assert not infers_onednn(x.bfloat16(), w, b)  # the weight in another dtype than the input's
        assert not infers_onednn(x.bfloat16(), w.bfloat16(), b)
        assert not infers_onednn(x.half(), w.half(), b.half()) and not infers_onednn(x64, w64, b64)
        assert not infers_onednn(x[..., 1:], w[:, 1:], b)  # in_features below MIN_SIDE
        assert not infers_onednn(x, w[: MIN_SIDE - 1], b[: MIN_SIDE - 1])  # out_features below MIN_SIDE
        assert not infers_onednn(x[0, 0], w, b)  # one vector, no rows
        assert infers_onednn(x, w[MIN_SIDE:], b[MIN_SIDE:])  # rows of a weight (the first-token block's qkv)
        assert not infers_onednn(x, w.t().contiguous().t(), b)  # a weight laid out by columns
        assert not infers_onednn(x.to("meta"), w.to("meta"), b.to("meta"))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert not infers_onednn(x, w, b)  # F.linear, whose weights autocast casts once for its context
        with FlopCounterMode(display=False):
            assert not infers_onednn(x, w, b)  # a dispatch mode sees ATen's ops (FLOPs counted)
    with torch.inference_mode():
        assert infers_onednn(x, w, b)
    with torch.no_grad():  # a tensor subclass (torchao's quantised weights) runs F.linear's ops its own way
        assert not infers_onednn(x, w.as_subclass(Tagged), b) and not infers_onednn(x.as_subclass(Tagged), w, b)
        assert not infers_onednn(x, w, b.as_subclass(Tagged))
    assert not infers_onednn(x, w, b)  # autograd records the product: training (uses_onednn, or F.linear)
    assert not infers_onednn(x, w.detach(), b)  # the bias alone records
    assert infers_onednn(x, w.detach(), b.detach())  # nothing records


def test_an_evaluating_vit_is_the_float64_models_function() -> None:
    """A model optimised for training, evaluated (eval mode, no autograd): its layers one oneDNN matmul each, the
    plain float64 model's logits to fp32 rounding, in inference_mode too."""
    model = training_vit().eval()
    with torch.no_grad():
        model.head.weight.normal_(std=0.1)
    reference = copy.deepcopy(model).double()
    images = torch.randn(4, 3, 32, 32)
    with torch.no_grad():
        want, got = reference(images.double()), model(images).double()
    with torch.inference_mode():
        again = model(images).double()
    assert (got - want).abs().max() <= 1e-5 * want.abs().max() and torch.equal(again, got)


def test_flop_counter_counts_an_optimised_cpu_vit_as_on_the_meta_device() -> None:
    """FlopCounterMode has no formula for oneDNN's matmul op: under it the layers run ATen's, on a CPU as on meta.
    (Attention written out: it has none for SDPA's CPU kernel either, which is torch's own.)"""
    model = training_vit(attn_impl="explicit").eval()
    for grad in (False, True):  # inference, and training's oneDNN layers (2,080 rows)
        with FlopCounterMode(display=False) as counter, torch.set_grad_enabled(grad):
            model(torch.randn(IMAGES, 3, 32, 32))
        assert counter.get_total_flops() == IMAGES * model_flops(model, 32, first_token=True), grad


def test_a_compiled_evaluating_model_traces_f_linear_in_one_graph(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = count_onednn_calls(monkeypatch)
    model = training_vit().eval()
    images = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.compile(model, backend="eager", fullgraph=True)(images)
        assert not calls
        model(images)  # the same call eagerly runs them, whatever the rows (block 1 computes the class token alone)
    assert len(calls) == 9  # qkv, proj, fc1, fc2; query, keys and values, proj, fc1, fc2


def test_the_main_jobs_64_wide_layers_keep_nn_linear(monkeypatch: pytest.MonkeyPatch) -> None:
    """The digits model's layers (width 64, MLP 128) are below oneDNN's sides in training and inference: there
    oneDNN ran no faster than nn.Linear (benchmarks/train_ceiling.py)."""
    calls = count_onednn_calls(monkeypatch)
    cfg = dict(img_size=16, patch_size=4, width=64, depth=2, num_heads=4, mlp_dim=128, num_classes=10)
    model = optimize_for_training(VisionTransformer(**cfg))
    assert not any(isinstance(m, OneDnnLinear) for m in model.modules())
    images = torch.randn(64, 3, 16, 16)
    model.train()(images).sum().backward()
    with torch.no_grad():
        model.eval()(images)
    assert not calls
