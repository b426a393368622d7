"""The written-out attention in chunks of (image, head) pairs (bf16 on a CPU): the function of the unchunked path,
against float64 and bit for bit, forward and backward, in a model, and only where it is meant to run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import vitkit.models.attention as attention
from vitkit.device import bf16_is_fast
from vitkit.models import VisionTransformer
from vitkit.models.attention import Attention, attention_chunk, chunked_attention


def _qkv(pairs: tuple[int, int], n: int, N: int, hd: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(*pairs, n, hd), (*pairs, N, hd), (*pairs, N, hd)]
    return [(torch.randn(s, generator=g) * 2).bfloat16().requires_grad_() for s in shapes]


def _float64(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, go: torch.Tensor) -> list[torch.Tensor]:
    """The output and the gradients of q, k, v in float64 from the same bf16 inputs, by the formula."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    out = torch.softmax(q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5, -1) @ v
    out.backward(go.double())
    return [out.detach(), q.grad, k.grad, v.grad]


def _unchunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, go: torch.Tensor) -> list[torch.Tensor]:
    """The explicit path as it runs unchunked: q scaled, two batched products and a softmax, in bf16."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = torch.softmax((q * q.shape[-1] ** -0.5) @ k.transpose(-2, -1), -1) @ v
    out.backward(go)
    return [out.detach(), q.grad, k.grad, v.grad]


def _chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, go: torch.Tensor, chunk: int) -> list[torch.Tensor]:
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = chunked_attention(q, k, v, q.shape[-1] ** -0.5, chunk)
    out.backward(go)
    return [out.detach(), q.grad, k.grad, v.grad]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("chunk", [1, 4, 7, 15])  # 15 pairs: chunks of 4 leave 3, of 7 leave 1
@pytest.mark.parametrize("n", [40, 1])  # every query, or the class token's alone (the last block's)
def test_chunks_give_the_unchunked_bits_and_the_float64_values_forward_and_backward(chunk, n, seed):
    q, k, v = _qkv((3, 5), n, 40, 16, seed)  # head_dim 16: the scale 1/4 is a power of two
    go = torch.randn(3, 5, n, 16, generator=torch.Generator().manual_seed(100 + seed)).bfloat16()
    got, same, exact = _chunked(q, k, v, go, chunk), _unchunked(q, k, v, go), _float64(q, k, v, go)
    for name, a, b, c in zip(("output", "q", "k", "v"), got, same, exact):
        assert a.dtype == torch.bfloat16 and a.shape == b.shape, name
        if n > 1:
            assert torch.equal(a, b), name
        else:  # one-row products: oneDNN sums them in another order for another batch of pairs (see the module)
            assert (a.double() - b.double()).abs().max() <= 2**-7 * b.double().abs().max(), name
        # bf16: the probabilities and their gradient rounded to 8 bits
        assert (a.double() - c).abs().max() <= 0.04 * c.abs().max(), name


def test_a_scale_that_is_no_power_of_two_is_rounded_once_and_lands_nearer_float64():
    q, k, v = _qkv((4, 6), 50, 50, 20, seed=1)  # head_dim 20: 1/sqrt(20) rounds in bf16 when it scales q
    go = torch.randn(4, 6, 50, 20).bfloat16()
    got, before, exact = _chunked(q, k, v, go, 5), _unchunked(q, k, v, go), _float64(q, k, v, go)
    for name, a, b, c in zip(("output", "q", "k", "v"), got, before, exact):
        assert (a.double() - c).abs().mean() <= (b.double() - c).abs().mean(), name


def test_without_autograd_recording_only_a_chunk_of_probabilities_is_held(monkeypatch):
    q, k, v = (t.detach() for t in _qkv((2, 6), 30, 30, 16))
    kept = []
    real = attention._chunked_forward

    def spy(*args, **kwargs):
        out, probs = real(*args, **kwargs)
        kept.append(probs)
        return out, probs

    monkeypatch.setattr(attention, "_chunked_forward", spy)
    with torch.no_grad():
        out = chunked_attention(q, k, v, 0.25, 5)
    assert kept == [None] and out.grad_fn is None
    torch.testing.assert_close(out, _unchunked(q, k, v, torch.zeros_like(q))[0], rtol=0, atol=0)


def test_a_gradient_of_the_gradient_is_refused():
    q, k, v = _qkv((2, 2), 8, 8, 16)
    (dq,) = torch.autograd.grad(chunked_attention(q, k, v, 0.25, 1).square().sum(), q, create_graph=True)
    with pytest.raises(RuntimeError):
        dq.sum().backward()


def test_chunks_are_sized_by_the_probabilities_bytes_and_run_only_where_they_can_gain():
    q = torch.zeros(32, 6, 197, 64, dtype=torch.bfloat16)
    per_pair = 197 * 197 * 2
    assert attention_chunk(q, q) == 2**21 // per_pair == 27  # ViT-S/16 at batch 32: 27 of its 192 pairs a chunk
    assert attention_chunk(q[:1, :, :1], q[:1]) is None  # every pair fits one chunk: unchunked
    assert attention_chunk(q.float(), q.float()) is None  # fp32 keeps its path
    assert attention_chunk(q, q, None) is None
    assert attention_chunk(q, q, 10) == 1  # a pair larger than a chunk: one pair at a time
    assert Attention(64, 4).chunk_bytes == attention.CHUNK_BYTES == 2**21


TINY = dict(img_size=32, patch_size=4, width=64, depth=2, num_heads=4, mlp_dim=64, num_classes=5)


def _model() -> VisionTransformer:
    torch.manual_seed(0)
    model = VisionTransformer(**TINY)
    with torch.no_grad():
        model.head.weight.normal_(std=0.5)
    return model


def _chunk_small(monkeypatch, model: torch.nn.Module) -> list[int]:
    """Chunks of 3 pairs for the tiny model (8 images x 4 heads = 32 pairs of 65 x 65); the chunk of each call."""
    for m in model.modules():
        if isinstance(m, Attention):
            m.chunk_bytes = 3 * 65 * 65 * 2
    used = []
    real = attention.chunked_attention

    def spy(q, k, v, scale, chunk):
        used.append(chunk)
        return real(q, k, v, scale, chunk)

    monkeypatch.setattr(attention, "chunked_attention", spy)
    return used


@pytest.mark.onednn_bf16
def test_a_bf16_autocast_training_step_of_a_model_is_the_unchunked_step_bit_for_bit(monkeypatch):
    x, y = torch.randn(8, 3, 32, 32), torch.arange(8) % 5
    results = []
    for chunked in (False, True):
        model = _model().train()
        if chunked:
            used = _chunk_small(monkeypatch, model)
        else:
            for blk in model.blocks:
                blk.attn.chunk_bytes = None
        with torch.autocast("cpu", torch.bfloat16):  # auto: the written-out path in bf16
            logits = model(x)
        torch.nn.functional.cross_entropy(logits.float(), y).backward()
        results.append([logits, *(p.grad for p in model.parameters())])
    assert used == [3]  # the first block on every token; the last computes the class token alone, unchunked
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_bf16_inference_is_the_unchunked_forward_and_the_probabilities_are_still_returned(monkeypatch):
    x = torch.randn(8, 3, 32, 32)
    model = _model().eval().bfloat16()
    with torch.no_grad():
        before = model.forward_features(x.bfloat16())  # one chunk holds every pair of this tiny model
        used = _chunk_small(monkeypatch, model)
        after = model.forward_features(x.bfloat16())
        assert used == [3, 3] and torch.equal(before, after)
        inter = model.forward_intermediates(x.bfloat16(), return_attention=True)  # needs the probabilities
    assert used == [3, 3] and len(inter["attention"]) == 2
    torch.testing.assert_close(inter["encoded"], after, rtol=0, atol=0)


@pytest.mark.parametrize("case", ["fp32", "dropout", "relative", "merge"])
def test_the_cases_it_does_not_cover_keep_the_unchunked_path(monkeypatch, case):
    torch.manual_seed(0)
    overrides = {
        "dropout": {"attn_dropout": 0.1},
        "relative": {"pos_embed": "relative_2d"},
        "merge": {"token_merge": 8, "depth": 3},
    }.get(case, {})
    model = VisionTransformer(**{**TINY, **overrides}).train()
    used = _chunk_small(monkeypatch, model)
    x = torch.randn(8, 3, 32, 32)
    with torch.autocast("cpu", torch.bfloat16, enabled=case != "fp32"):
        model(x, attn_impl="explicit").float().sum().backward()
    # token merging: the first block, before any merge, has no size bias; the second has (the third computes the
    # class token alone)
    assert used == ([3] if case == "merge" else [])


def test_the_int8_models_bf16_attention_runs_in_chunks_eagerly(monkeypatch):
    attn = Attention(64, 4)
    attn.attend_dtype = torch.bfloat16
    used = _chunk_small(monkeypatch, attn)
    x = torch.randn(8, 65, 64)
    with torch.no_grad():
        out = attn(x)
        reference = attn.forward_explicit(x)[0]  # with the probabilities: unchunked
    assert used == [3] and out.dtype == torch.float32
    torch.testing.assert_close(out, reference, rtol=0, atol=0)


SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "attention_chunks.py"


@pytest.mark.skipif(not bf16_is_fast(torch.device("cpu")), reason="times bf16 on a CPU where it is emulated")
def test_the_benchmark_times_each_chunk_size_and_both_inference_paths_with_the_same_logits(script, capsys) -> None:
    script.main(["--parts", "1,3", "--chunks", "27,96", "--batch", "3", "--rounds", "1"])
    out = capsys.readouterr().out
    assert "  chunks of  27 (vitkit's)" in out and "  chunks of  96 " in out  # 2 MiB over a 197 x 197 pair: 27
    assert "ViT-B/16 bf16 inference, eager, batch 3 (logits the same bits: yes)" in out  # 36 pairs: chunks of 27


def test_the_benchmarks_unchunked_arm_turns_every_attention_layers_chunks_off(script) -> None:
    model = script.unchunked(VisionTransformer(**TINY))
    assert [blk.attn.chunk_bytes for blk in model.blocks] == [None, None]
    assert Attention(64, 4).chunk_bytes == attention.CHUNK_BYTES  # the class default is untouched
