"""What the machine can do (CPU flags, native bf16, autocast by precision name) and pixels from model inputs
(un-normalising, patches), each asked in one place and checked here against a direct computation."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from vitkit import device
from vitkit.pixels import patches_of, unnormalise
from vitkit.predict import Preprocessing


@pytest.mark.skipif(not Path("/proc/cpuinfo").is_file(), reason="no /proc/cpuinfo on this system")
def test_cpu_flags_and_name_are_the_first_processors():
    lines = Path("/proc/cpuinfo").read_text().splitlines()
    flags = next(line.split(":", 1)[1].split() for line in lines if line.startswith("flags"))
    assert device.cpu_flags() == frozenset(flags)
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    assert device.cpu_model_name() == (names[0] if names else None)
    assert device.cpu_has_vnni() == any(f in flags for f in ("avx512_vnni", "avx_vnni", "amx_int8"))
    assert device.cpu_has_fast_bf16() == ("amx_bf16" in flags or "avx512_bf16" in flags)
    assert device.bf16_is_fast(torch.device("cpu")) == device.cpu_has_fast_bf16()
    assert not device.bf16_is_fast(torch.device("meta"))


def test_seed_rng_draws_as_torch_manual_seed_on_the_cpu():
    torch.manual_seed(1234)
    want = (torch.rand(5), torch.randn(3), torch.randperm(10), torch.empty(6).bernoulli_(0.3))
    torch.manual_seed(0)
    device.seed_rng(1234)
    got = (torch.rand(5), torch.randn(3), torch.randperm(10), torch.empty(6).bernoulli_(0.3))
    device.seed_rng(1234, torch.device("cpu"))
    assert torch.equal(torch.rand(5), want[0])
    for w, g in zip(want, got):
        assert torch.equal(w, g)


def test_autocast_by_precision_name():
    a, b = torch.randn(4, 8), torch.randn(8, 3)
    with device.autocast("cpu", "none"):
        assert (a @ b).dtype == torch.float32
    with device.autocast(torch.device("cpu"), "bf16"):
        out = a @ b
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), a @ b, atol=0.1, rtol=0.05)
    with pytest.raises(ValueError, match="amp 'fp8'"):
        device.autocast("cpu", "fp8")


@pytest.mark.parametrize("mean, std", [([0.5], [0.5]), ([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
def test_unnormalise_inverts_the_normalisation_and_clamps(mean, std):
    gen = torch.Generator().manual_seed(0)
    pixels = torch.rand(2, len(mean), 5, 6, generator=gen, dtype=torch.float64)
    normalised = torch.stack([(pixels[:, c] - mean[c]) / std[c] for c in range(len(mean))], dim=1)
    torch.testing.assert_close(unnormalise(normalised.float(), mean, std).double(), pixels, atol=1e-6, rtol=0)
    assert float(unnormalise(torch.full((1, len(mean), 1, 1), 1e3), mean, std).max()) == 1.0  # clamped to [0, 1]
    prep = Preprocessing(img_size=5, mean=mean, std=std, in_chans=len(mean))
    torch.testing.assert_close(
        prep.to_display(normalised[0].float()), unnormalise(normalised[0].float(), mean, std).permute(1, 2, 0)
    )


def test_patches_are_in_the_patch_embeddings_token_order():
    images = torch.arange(2 * 3 * 9 * 13, dtype=torch.float32).reshape(2, 3, 9, 13)
    got = patches_of(images, (4, 3))  # a 2 x 4 grid; the border row and column are dropped, as the embedding does
    assert got.shape == (2, 8, 3, 4, 3)
    for b in range(2):
        for r in range(2):
            for c in range(4):
                assert torch.equal(got[b, r * 4 + c], images[b, :, 4 * r : 4 * r + 4, 3 * c : 3 * c + 3])
    # the same order as the model's tokens: a linear patch embedding of the patches equals the conv's output
    conv = torch.nn.Conv2d(3, 5, (4, 3), stride=(4, 3))
    tokens = conv(images).flatten(2).transpose(1, 2)  # (B, N, D), row-major
    torch.testing.assert_close(got.flatten(2) @ conv.weight.flatten(1).T + conv.bias, tokens, rtol=1e-5, atol=1e-4)
