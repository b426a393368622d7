"""CUDA only: SDPA's flash kernel in a bf16 forward, mixed-precision training through the engine, and a compiled
training step against eager. (The inference switch's CUDA defaults and CUDA graphs: tests/accel/test_inference.py.)"""

from __future__ import annotations

import json
import math

import pytest
import torch
from test_train import tiny
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from vitkit.models import create_model
from vitkit.train import Trainer, config_from_dict

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

CUDA = torch.device("cuda")
ATTENTION_WORDS = ("flash", "fmha", "attention", "sdpa")  # in the names of SDPA's CUDA kernels


def fixed_batch(tmp_path, name: str, *overrides: str):
    """A tiny run on CUDA whose every step trains on the same 16 images: a 16-image train split, batches of 16."""
    doc = tiny(tmp_path, data={"synthetic_size": 20}, schedule={"steps": 10, "warmup_steps": 1}, optim={"lr": 1e-2})
    return config_from_dict(doc, ["run.device=cuda", f"run.name={name}", "run.log_every=1", *overrides])


def test_a_bf16_vit_forward_runs_sdpa_as_flash_attention():
    """ViT-S/16 (head_dim 64) in bf16 eval, attn_impl="auto", runs its attention in a flash kernel."""
    torch.manual_seed(0)
    model = create_model("vit_s16").eval().to(CUDA, torch.bfloat16)
    x = torch.randn(2, 3, 224, 224).to(CUDA, torch.bfloat16)
    with torch.no_grad():
        model(x, attn_impl="auto")  # the first call's library set-up stays out of the profile
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            model(x, attn_impl="auto")
            torch.cuda.synchronize()
    kernels = sorted({event.name for event in prof.events() if event.device_type == DeviceType.CUDA})
    attention = [k for k in kernels if any(word in k.lower() for word in ATTENTION_WORDS)]
    print("attention kernels:", *attention, sep="\n  ")
    assert any("flash" in k.lower() for k in kernels), kernels


@pytest.mark.parametrize("amp", ["bf16", "fp16"])
def test_mixed_precision_training_lowers_the_loss_on_a_fixed_batch(tmp_path, amp):
    """The engine trains under autocast on CUDA: the loss on a batch seen at every step falls, and fp16 (only)
    scales it through an enabled GradScaler that ends at a finite scale."""
    trainer = Trainer(fixed_batch(tmp_path, amp, f"run.amp={amp}"))
    try:
        assert len(trainer.train_ds) == trainer.cfg.optim.batch_size
        assert trainer.scaler.is_enabled() == (amp == "fp16")
        result = trainer.fit()
    finally:
        trainer.close()
    records = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if r["kind"] == "train"]
    assert len(losses) == 10 and all(math.isfinite(v) for v in losses), losses
    assert losses[-1] < 0.5 * losses[0], losses
    if amp == "fp16":
        assert 0 < trainer.scaler.get_scale() < math.inf


@pytest.mark.parametrize("amp, rtol", [("none", 1e-4), ("bf16", 2e-2)])
def test_a_compiled_training_step_matches_eager(tmp_path, amp, rtol):
    """run.compile=true, and run.compile=reduce-overhead (CUDA graphs: warmed up at the first step, recorded at the
    second, replayed from the third), train to eager's losses, in fp32 and in bf16 autocast: four steps, each but
    the first after a compiled backward and SGD update. The head is made random, as a zero head gives log K for
    any model."""
    losses = {}
    for compile_ in ("false", "true", "reduce-overhead"):
        overrides = [f"run.amp={amp}", f"run.compile={compile_}", "optim.name=sgd", "optim.lr=0.1"]
        trainer = Trainer(fixed_batch(tmp_path, f"{amp}-{compile_}", *overrides))
        try:
            head = trainer.model.head.weight
            with torch.no_grad():
                head.copy_(0.2 * torch.randn(head.shape, generator=torch.Generator().manual_seed(0)))
            batches = trainer.batches(0)
            losses[compile_] = [trainer.train_step(batches) for _ in range(4)]
        finally:
            trainer.close()
    assert abs(losses["false"][0] - math.log(4)) > 1e-2  # a random head: the loss depends on the whole forward
    assert len(set(losses["false"])) == 4  # every step changed the weights
    assert losses["true"] == pytest.approx(losses["false"], rel=rtol)
    assert losses["reduce-overhead"] == pytest.approx(losses["false"], rel=rtol)
