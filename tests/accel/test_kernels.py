"""vitkit.accel.kernels: the tanh GELU's compiled CPU kernels (TanhGELU, swapped in by optimize_for_training)
against float64, where they apply, and how they are compiled and cached."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from vitkit.accel import kernels as kernels_mod
from vitkit.accel import optimize_for_training
from vitkit.models import VisionTransformer
from vitkit.models.vit import Mlp


def tanh_gelu64(x: torch.Tensor) -> torch.Tensor:
    """The official (Flax) GELU written out from its definition, in float64."""
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def bf16_inputs() -> torch.Tensor:
    torch.manual_seed(0)
    return torch.cat([torch.linspace(-12, 12, 4801), torch.randn(20000) * 3]).bfloat16()


def assert_rounded(got: torch.Tensor, exact: torch.Tensor, within_ulp: bool = False) -> None:
    """Every bf16 value is the float64 value correctly rounded, except where both are below 1e-12; or, with
    ``within_ulp``, 99.9% of them are and every one is within one bf16 step (2^-8 relative) of the exact value."""
    tiny = (got.double() - exact).abs() <= 1e-12
    wrong = (got != exact.bfloat16()) & ~tiny
    if within_ulp:
        assert wrong.double().mean() < 1e-3, f"{int(wrong.sum())} of {wrong.numel()} not correctly rounded"
        wrong &= (got.double() - exact).abs() > 2**-8 * exact.abs()
    assert not wrong.any(), f"{int(wrong.sum())} values off, e.g. {got[wrong][:4]} vs {exact[wrong][:4]}"


def test_bf16_tanh_gelu_and_gradient_are_the_float64_values_rounded() -> None:
    x = bf16_inputs().requires_grad_()
    y = kernels_mod.TanhGELU(approximate="tanh")(x)
    grad = torch.randn(y.shape).bfloat16()
    y.backward(grad)
    x64 = x.detach().double().requires_grad_()
    y64 = tanh_gelu64(x64)
    y64.backward(grad.double())
    assert kernels_mod._kernels(torch.bfloat16) is not None  # the compiled kernels ran, not the fallback
    assert y.dtype == x.grad.dtype == torch.bfloat16
    assert_rounded(y.detach(), y64.detach())
    assert_rounded(x.grad, x64.grad, within_ulp=True)  # computed in fp32 from a bf16 gradient, then rounded


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_gradient_and_output_kernel_gives_the_other_two_kernels_bits(dtype: torch.dtype) -> None:
    """The kernel the MLP's second layer recomputes the GELU with: its gradient and its output, bit for bit."""
    x = bf16_inputs().to(dtype)
    grad = torch.randn(x.shape).to(dtype)
    kernels = kernels_mod._kernels(dtype)
    assert kernels is not None
    gx, y = kernels.backward_and_output(grad.view(-1, 7), x.view(-1, 7))  # any shape
    assert gx.shape == y.shape == (x.numel() // 7, 7)
    assert torch.equal(gx.view(-1), kernels.backward(grad, x)) and torch.equal(y.view(-1), kernels.forward(x))
    if dtype == torch.bfloat16:
        assert_rounded(y.view(-1), tanh_gelu64(x.double()))


def test_aten_kernel_rounds_worse_than_ours() -> None:
    """Why the kernel exists beside speed: ATen's bf16 tanh-GELU is off by more than rounding for x < -3."""
    x = bf16_inputs()
    exact = tanh_gelu64(x.double())
    aten = F.gelu(x, approximate="tanh")
    assert ((aten != exact.bfloat16()) & ((aten.double() - exact).abs() > 1e-6)).any()


def test_inference_fp32_and_exact_gelu_keep_atens_kernel() -> None:
    x = bf16_inputs()
    tanh = kernels_mod.TanhGELU(approximate="tanh")
    with torch.no_grad():
        assert torch.equal(tanh(x.requires_grad_()), F.gelu(x, approximate="tanh"))
    assert torch.equal(tanh.eval()(x), F.gelu(x, approximate="tanh"))  # eval mode: inference, recorded or not
    tanh.train()
    x = x.detach()
    assert torch.equal(tanh(x), F.gelu(x, approximate="tanh"))  # no autograd record: inference
    x32 = x.float().requires_grad_()
    assert torch.equal(tanh(x32), F.gelu(x32, approximate="tanh"))
    exact = torch.nn.GELU()
    assert kernels_mod.swap_gelus(exact) == 0 and type(exact) is torch.nn.GELU  # an exact GELU is not swapped


def test_inside_a_compiled_model_the_same_function() -> None:
    x = bf16_inputs().requires_grad_()
    y = torch.compile(kernels_mod.gelu_tanh)(x)
    y.sum().backward()
    x64 = x.detach().double().requires_grad_()
    y64 = tanh_gelu64(x64)
    y64.sum().backward()
    assert (y.detach().double() - y64).abs().max() <= 2**-8 * y64.abs().max()
    assert (x.grad.double() - x64.grad).abs().max() <= 2**-7


def test_compiled_on_a_cpu_the_gelu_is_the_sigmoid_form_in_fp32_too() -> None:
    """In a traced CPU graph, any precision: no tanh for inductor to lower slowly, and the same function."""
    graphs = []

    def capture(gm: torch.fx.GraphModule, example_inputs: list) -> torch.fx.GraphModule:
        graphs.append({str(node.target) for node in gm.graph.nodes})
        return gm

    x = torch.linspace(-8, 8, 16001)
    y = torch.compile(kernels_mod.TanhGELU(approximate="tanh").eval(), backend=capture)(x)
    assert any("sigmoid" in t for t in graphs[0]) and not any("tanh" in t or "gelu" in t for t in graphs[0])
    assert (y.double() - tanh_gelu64(x.double())).abs().max() < 1e-6
    assert (torch.compile(kernels_mod.gelu_tanh)(x).double() - tanh_gelu64(x.double())).abs().max() < 1e-6  # inductor


@pytest.mark.filterwarnings("ignore:dynamo_pgo force disabled")
def test_the_kernels_split_their_loop_over_the_threads_whatever_length_compiled_them() -> None:
    """Built on a 64-element probe, inductor would judge the loop too short to split and its cache would serve that
    one-thread kernel to every later length; the kernels are compiled with the parallel loop all the same."""
    from torch._inductor import config
    from torch._inductor.utils import run_and_get_code

    for kernel, inputs in (
        (kernels_mod._forward, 1),
        (kernels_mod._backward, 2),
        (kernels_mod._backward_and_output, 2),
    ):
        with config.patch(force_disable_caches=True):  # the code generated now, not a cached kernel
            _, code = run_and_get_code(kernels_mod._compile(kernel), *[torch.linspace(-4, 4, 64)] * inputs)
        assert code and all("#pragma omp parallel" in c for c in code), kernel.__name__


def test_one_compilation_serves_every_shape() -> None:
    """Compiled once on the probe, for flat tensors of any length: no caller's shape compiles them again (a view
    would bring its base's shape into the guards, recompiling for each new one, and after 8 dynamo runs the function
    eagerly)."""
    torch._dynamo.reset()
    kernels_mod._kernels.cache_clear()
    kernels_mod._kernels(torch.bfloat16)  # compiled here
    with torch._dynamo.config.patch(error_on_recompile=True):
        for shape in ((4, 197, 96), (4, 1, 96), (3, 5), (7,), (2, 1, 1, 9)):
            x = torch.randn(shape).bfloat16().requires_grad_()
            kernels_mod.gelu_tanh(x).sum().backward()
            kernels_mod.gelu_tanh(x.detach().transpose(0, -1).requires_grad_()).sum().backward()  # not contiguous


def test_a_kernel_that_cannot_be_compiled_warns_once_and_uses_atens(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_compiler(fn, **kwargs):
        def fail(*args):
            raise RuntimeError("no C++ compiler found\nmore detail")

        return fail

    kernels_mod._kernels.cache_clear()
    monkeypatch.setattr(kernels_mod.torch, "compile", no_compiler)
    try:
        x = bf16_inputs().requires_grad_()
        with pytest.warns(UserWarning, match=r"could not be compiled \(no C\+\+ compiler found\); using ATen's"):
            y = kernels_mod.gelu_tanh(x)
        assert torch.equal(y, F.gelu(x, approximate="tanh"))
        y.sum().backward()  # and no second warning: the failure is remembered
    finally:
        kernels_mod._kernels.cache_clear()


def test_the_models_mlp_trains_in_bf16_autocast_with_the_kernel() -> None:
    """A ViT step under CPU bf16 autocast: the MLP's GELU (swapped by optimize_for_training) runs the kernel, and the
    gradients match ATen's GELU."""
    torch.manual_seed(0)
    cfg = dict(img_size=32, patch_size=8, width=192, depth=2, num_heads=3, mlp_dim=768, num_classes=5)
    plain = VisionTransformer(**cfg)
    assert all(type(m.act) is torch.nn.GELU for m in plain.modules() if isinstance(m, Mlp))
    model = optimize_for_training(plain)
    assert all(type(m.act) is kernels_mod.TanhGELU for m in model.modules() if isinstance(m, Mlp))
    x, y = torch.rand(4, 3, 32, 32), torch.tensor([0, 1, 2, 3])
    ran: list[int] = []
    model.blocks[0].mlp.act.register_forward_hook(lambda m, args, out: ran.append(out.grad_fn.name()))

    def grads() -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", torch.bfloat16):
            F.cross_entropy(model(x), y).backward()
        return [p.grad.clone() for p in model.parameters()]

    ours = grads()
    assert ran == ["_GeluTanhBackward"]
    for m in model.modules():
        if isinstance(m, Mlp):
            m.act = torch.nn.GELU(approximate="tanh")
    aten = grads()
    for a, b in zip(ours, aten, strict=True):
        assert torch.allclose(a, b, rtol=0.05, atol=0.02 * b.abs().max().item() + 1e-6)


def test_fp32_training_from_the_threshold_runs_the_kernel_within_rounding_of_float64() -> None:
    """Large fp32 activations in training take the kernel (ATen's fp32 tanh-GELU is as slow as its bf16 one);
    below FP32_MIN_NUMEL elements ATen's kernel runs, computing the same function."""
    torch.manual_seed(0)
    n = kernels_mod.FP32_MIN_NUMEL
    x = torch.cat([torch.linspace(-12, 12, n // 2), torch.randn(n // 2) * 3]).requires_grad_()
    y = kernels_mod.TanhGELU(approximate="tanh")(x)
    assert type(y.grad_fn).__name__ == "_GeluTanhBackward"
    grad = torch.randn(n)
    y.backward(grad)
    x64 = x.detach().double().requires_grad_()
    y64 = tanh_gelu64(x64)
    y64.backward(grad.double())
    big = y64.abs() > 1e-6
    assert ((y.detach().double() - y64).abs() / y64.abs())[big].max() < 4e-6  # ATen's own: 0.067 in the tails
    assert (x.grad.double() - x64.grad).abs().max() < 2e-6 * x64.grad.abs().max()
    small = x.detach()[: n - 1].requires_grad_()
    assert kernels_mod.TanhGELU(approximate="tanh")(small).grad_fn.name() == "GeluBackward0"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_gradient_of_the_gradient_is_the_gelus_second_derivative(dtype: torch.dtype) -> None:
    """Where the kernels run, a backward pass that builds a graph (a gradient penalty) records ATen's GELU gradient
    in fp32: the gradient and its gradient, the GELU's second derivative, are float64's within rounding. A backward
    pass that builds none still runs the kernel."""
    torch.manual_seed(0)
    n = kernels_mod.FP32_MIN_NUMEL
    x64 = torch.cat([torch.linspace(-6, 6, n // 2), torch.randn(n // 2) * 3]).double()
    u = torch.randn(n, dtype=torch.float64)

    def penalty_grad(x: torch.Tensor, gelu) -> tuple[torch.Tensor, torch.Tensor]:
        x = x.detach().requires_grad_()
        y = gelu(x)
        (gx,) = torch.autograd.grad((y.double() * u).sum(), x, create_graph=True)
        (ggx,) = torch.autograd.grad((gx.double() * u).sum(), x)
        return gx.detach().double(), ggx.double()

    gelu = kernels_mod.TanhGELU(approximate="tanh")
    x = x64.to(dtype)
    assert type(gelu(x.requires_grad_()).grad_fn).__name__ == "_GeluTanhBackward"  # the kernels' function
    gx, ggx = penalty_grad(x, gelu)
    gx64, ggx64 = penalty_grad(x.double(), tanh_gelu64)  # the definition at the same (rounded) inputs
    tol = 2e-6 if dtype == torch.float32 else 1e-2  # bf16: the gradient is rounded to bf16 (2^-9)
    assert (gx - gx64).abs().max() <= tol * gx64.abs().max()
    assert (ggx - ggx64).abs().max() <= tol * ggx64.abs().max()
    plain = x.detach().requires_grad_()  # a backward pass that builds no graph: the kernel's gradient, as before
    gelu(plain).backward(u.to(dtype))
    assert torch.allclose(plain.grad.double(), gx64, rtol=0, atol=tol * gx64.abs().max().item())


# One process: vitkit's bf16 kernels against ATen's GELU in float64 (forward, and the gradient), on torch.compile's
# cache in TORCHINDUCTOR_CACHE_DIR; within a bf16 rounding of values up to 12. Prints "ok" or what was off.
_KERNELS_AGAINST_FLOAT64 = """
import torch
import torch.nn.functional as F
from vitkit.accel import kernels as gelu
x = torch.cat([torch.linspace(-12, 12, 4801), torch.randn(20000) * 3]).bfloat16()
k = gelu._kernels(torch.bfloat16)
x64 = x.double().requires_grad_()
want = F.gelu(x64, approximate="tanh")
(want_grad,) = torch.autograd.grad(want.sum(), x64)
got, got_grad = k.forward(x).double(), k.backward(torch.ones_like(x), x).double()
errors = [float((got - want).abs().max()), float((got_grad - want_grad).abs().max())]
print("ok" if all(e <= 0.07 for e in errors) else f"off by {errors}")
"""


def test_the_kernels_cache_entries_are_keyed_on_the_vector_width(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.compile's on-disk cache keys an entry on its compile options, not on ATen's CPU capability: the kernels
    are compiled with the vector width inductor picks (cpp.simdlen) and the parallel loop (cpp.dynamic_threads) as
    options, so that kernels compiled for one width are never served to a process held to another (the test below
    runs that on an AVX512 CPU)."""
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    seen: list[dict] = []
    monkeypatch.setattr(kernels_mod.torch, "compile", lambda fn, **kwargs: seen.append(kwargs) or fn)
    assert kernels_mod._compile(kernels_mod._forward) is kernels_mod._forward
    width = pick_vec_isa().bit_width()
    assert width or not torch.backends.cpu.get_cpu_capability().startswith("AVX")
    options = {"cpp.dynamic_threads": True, **({"cpp.simdlen": width} if width else {})}
    assert seen == [{"dynamic": True, "options": options}]


@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() != "AVX512", reason="needs an AVX512 CPU")
def test_kernels_cached_under_avx512_are_not_served_to_a_process_held_to_avx2(tmp_path) -> None:
    """torch.compile's on-disk cache served kernels compiled under ATen's AVX512 capability to a process started
    with ATEN_CPU_CAPABILITY=avx2, where they gave NaN and garbage; vitkit's kernels are keyed on the vector width."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}
    for capability in ("avx512", "avx2"):
        run = [sys.executable, "-c", _KERNELS_AGAINST_FLOAT64]
        out = subprocess.run(run, env={**env, "ATEN_CPU_CAPABILITY": capability}, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.strip() == "ok", f"{capability}: {out.stdout.strip()}"
