"""Few-shot linear evaluation: the closed form against direct solvers, the protocol, and a model end to end."""

import json

import pytest
import torch

from vitkit.evaluate import fewshot, fewshot_from_features, ridge_regression, whiten
from vitkit.evaluate.fewshot import BIAS_CONSTANT, linear_fewshot_accuracy, sample_shots
from vitkit.models import ResNet, VisionTransformer


def ridge_by_lstsq(x: torch.Tensor, y: torch.Tensor, l2: float) -> torch.Tensor:
    """Ridge as ordinary least squares on the augmented system [X; sqrt(l2) I] W = [Y; 0] (no normal equations)."""
    d = x.shape[1]
    a = torch.cat([x, l2**0.5 * torch.eye(d, dtype=x.dtype)])
    b = torch.cat([y, torch.zeros(d, y.shape[1], dtype=y.dtype)])
    return torch.linalg.lstsq(a, b, driver="gelsd").solution


@pytest.mark.parametrize("n, d", [(200, 30), (12, 80)], ids=["primal n>d", "dual n<d"])
@pytest.mark.parametrize("l2", [1e-2, 2.0**10])
def test_ridge_closed_form_matches_direct_solvers(n, d, l2):
    gen = torch.Generator().manual_seed(n + d)
    x = torch.randn(n, d, generator=gen, dtype=torch.float64)
    y = 2.0 * torch.nn.functional.one_hot(torch.randint(0, 5, (n,), generator=gen), 5).double() - 1.0
    w = ridge_regression(x, y, l2)
    assert w.shape == (d, 5)
    torch.testing.assert_close(w, ridge_by_lstsq(x, y, l2), rtol=1e-7, atol=1e-9)
    explicit = torch.linalg.inv(x.T @ x + l2 * torch.eye(d, dtype=x.dtype)) @ x.T @ y  # the textbook primal form
    torch.testing.assert_close(w, explicit, rtol=1e-6, atol=1e-9)


def test_whitening_uses_the_subset_statistics_and_a_constant_bias():
    gen = torch.Generator().manual_seed(0)
    train = 3.0 + 2.0 * torch.randn(50, 4, generator=gen, dtype=torch.float64)
    test = torch.randn(7, 4, generator=gen, dtype=torch.float64)
    w_train, w_test = whiten(train, test)
    torch.testing.assert_close(w_train[:, :4].mean(0), torch.zeros(4, dtype=torch.float64), atol=1e-12, rtol=0)
    torch.testing.assert_close(
        w_train[:, :4].std(0, correction=0), torch.ones(4, dtype=torch.float64), atol=1e-5, rtol=0
    )
    assert torch.all(w_train[:, 4] == BIAS_CONSTANT) and torch.all(w_test[:, 4] == BIAS_CONSTANT)
    expected = (test - train.mean(0)) / (train.std(0, correction=0) + 1e-5)
    torch.testing.assert_close(w_test[:, :4], expected)


def test_accuracy_matches_an_independent_reference():
    """The whole pipeline (whiten, bias, {-1, 1} targets, ridge, argmax) written out again with lstsq."""
    gen = torch.Generator().manual_seed(1)
    centres = 2 * torch.randn(4, 16, generator=gen)
    train_y, test_y = torch.arange(4).repeat(3), torch.randint(0, 4, (60,), generator=gen)
    train_x = centres[train_y] + 1.5 * torch.randn(12, 16, generator=gen)
    test_x = centres[test_y] + 1.5 * torch.randn(60, 16, generator=gen)
    mean, std = train_x.double().mean(0), train_x.double().std(0, correction=0) + 1e-5
    xtr = torch.cat([(train_x - mean) / std, torch.full((12, 1), 100.0, dtype=torch.float64)], 1)
    xte = torch.cat([(test_x - mean) / std, torch.full((60, 1), 100.0, dtype=torch.float64)], 1)
    targets = 2.0 * torch.nn.functional.one_hot(train_y, 4).double() - 1.0
    pred = (xte @ ridge_by_lstsq(xtr, targets, 8.0)).argmax(1)
    expected = (pred == test_y).double().mean().item()
    assert linear_fewshot_accuracy(train_x, train_y, test_x, test_y, 4, l2=8.0) == pytest.approx(expected)


def test_shot_subsets_are_balanced_nested_and_seeded():
    labels = torch.arange(5).repeat_interleave(30)[torch.randperm(150, generator=torch.Generator().manual_seed(0))]
    subsets = sample_shots(labels, 5, (1, 5, 10), seed=3)
    for k, idx in subsets.items():
        assert torch.bincount(labels[idx], minlength=5).tolist() == [k] * 5
        assert len(set(idx.tolist())) == 5 * k
    assert set(subsets[1].tolist()) <= set(subsets[5].tolist()) <= set(subsets[10].tolist())
    assert torch.equal(sample_shots(labels, 5, (5,), seed=3)[5], subsets[5])
    assert not torch.equal(sample_shots(labels, 5, (5,), seed=4)[5], subsets[5])
    with pytest.raises(ValueError, match="class 0 has 30 training examples"):
        sample_shots(labels, 5, (31,), seed=0)


def test_one_shot_is_perfect_on_separable_features():
    # Six random cluster centres in 64-d with a small spread in every dimension. (Whitening rescales every
    # feature to unit variance, so the signal must live in all dimensions, not in a few next to pure noise.)
    gen = torch.Generator().manual_seed(0)
    centres = torch.randn(6, 64, generator=gen)
    train_y, test_y = torch.arange(6).repeat(20), torch.arange(6).repeat(10)
    train_x = centres[train_y] + 0.05 * torch.randn(120, 64, generator=gen)
    test_x = centres[test_y] + 0.05 * torch.randn(60, 64, generator=gen)
    result = fewshot_from_features(train_x, train_y, test_x, test_y, shots=(1, 5), seeds=3)
    assert result.accuracy[1] == [1.0, 1.0, 1.0]
    assert result.mean(5) == 1.0 and result.std(1) == 0.0
    assert result.to_dict()["results"]["1"]["per_seed"] == [1.0, 1.0, 1.0]
    assert "1.00 +-" not in result.table() and "100.00 +-  0.00" in result.table()


def test_random_labels_give_chance_accuracy():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(400, 32, generator=gen)
    y = torch.randint(0, 4, (400,), generator=gen)
    result = fewshot_from_features(x[:200], y[:200], x[200:], y[200:], shots=(10,), seeds=3)
    assert 0.1 < result.mean(10) < 0.45


def _tinted(n: int, num_classes: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Noise images tinted by a per-class colour: a random network's pooled features separate them.

    (A class-dependent *position* of a bright patch would not do: an untrained ViT averages its tokens almost
    uniformly, and the average of the patches does not depend on where the bright one is.)
    """
    gen = torch.Generator().manual_seed(seed)
    tints = torch.tensor([[1.0, -1.0, 0.0], [-1.0, 1.0, 0.5], [0.0, 0.5, -1.0], [0.7, 0.7, 0.7]])[:num_classes]
    y = torch.arange(num_classes).repeat(n // num_classes)
    x = 0.3 * torch.randn(len(y), 3, 16, 16, generator=gen) + tints[y][:, :, None, None]
    return x, y


@pytest.mark.parametrize("arch", ["vit_token", "vit_gap_prelogits", "resnet"])
def test_fewshot_on_frozen_models(arch):
    torch.manual_seed(0)
    if arch == "resnet":
        model = ResNet(layers=(1,), width_factor=0.5, num_classes=4, img_size=16)
    else:
        extra = {"classifier": "gap", "representation_size": 24} if arch == "vit_gap_prelogits" else {}
        model = VisionTransformer(img_size=16, patch_size=4, width=32, depth=1, num_heads=2, mlp_dim=64, **extra)
    train, test = _tinted(48, 4, seed=0), _tinted(40, 4, seed=1)
    dataset = torch.utils.data.TensorDataset(*train)  # a Dataset of (image, label) pairs; test stays tensors
    result = fewshot(model, dataset, test, shots=(1, 5), seeds=2, batch_size=16)
    assert result.feature_dim == {"resnet": 128, "vit_token": 32, "vit_gap_prelogits": 24}[arch]
    assert result.num_test == 40 and result.num_classes == 4
    assert result.mean(5) >= 0.9


def test_fewshot_cli_on_the_checkpoints_own_data(tmp_path, capsys):
    from vitkit.checkpoint.native import save_pretrained
    from vitkit.cli import main

    torch.manual_seed(0)
    model = VisionTransformer(img_size=16, patch_size=4, in_chans=1, width=32, depth=1, num_heads=2, mlp_dim=64)
    meta = {"source": "digits", "class_names": [str(d) for d in range(10)], "img_size": 16, "in_chans": 1}
    save_pretrained(model, tmp_path / "ckpt", metadata=meta)
    out = tmp_path / "fewshot.json"
    assert main(["fewshot", str(tmp_path / "ckpt"), "--shots", "1", "5", "--seeds", "2", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["data"]["source"] == "digits" and doc["data"]["train_augment"] == "none"
    assert doc["num_classes"] == 10 and doc["num_test"] == 360 and doc["feature_dim"] == 32
    five = doc["results"]["5"]
    assert len(five["per_seed"]) == 2 and five["mean"] == pytest.approx(sum(five["per_seed"]) / 2)
    assert five["mean"] > 0.2  # even the features of an untrained ViT beat chance (0.1) on the digits
    printed = capsys.readouterr().out
    assert f"{100 * five['mean']:6.2f} +- {100 * five['std']:5.2f}" in printed


def test_fewshot_cli_replaces_its_results_only_with_force(tmp_path, capsys):
    from vitkit.checkpoint.native import save_pretrained
    from vitkit.cli import main

    torch.manual_seed(0)
    model = VisionTransformer(img_size=16, patch_size=4, in_chans=1, width=32, depth=1, num_heads=2, mlp_dim=64)
    meta = {"source": "digits", "class_names": [str(d) for d in range(10)], "img_size": 16, "in_chans": 1}
    ckpt = save_pretrained(model, tmp_path / "ckpt", metadata=meta)
    out = ckpt / "fewshot.json"  # the default: in the checkpoint's directory
    assert main(["fewshot", str(ckpt), "--shots", "1", "--seeds", "1"]) == 0
    first = out.read_text()
    assert list(json.loads(first)["results"]) == ["1"]
    capsys.readouterr()
    assert main(["fewshot", str(ckpt), "--shots", "2", "--seeds", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"vitkit fewshot: error: {out}: exists; pass --force to replace it"]
    assert out.read_text() == first
    assert main(["fewshot", str(ckpt), "--shots", "2", "--seeds", "1", "--force"]) == 0
    assert list(json.loads(out.read_text())["results"]) == ["2"]


# ------------------------------------------------------------------------------------- the evaluation loop
class _Items(torch.utils.data.Dataset):
    """A data set read item by item (no tensors to slice): the DataLoader road."""

    def __init__(self, images, labels):
        self.images_, self.labels_ = images, labels

    def __len__(self):
        return len(self.labels_)

    def __getitem__(self, i):
        return self.images_[i], int(self.labels_[i])


def test_one_evaluation_loop_scores_every_kind_of_data_alike():
    from vitkit.data import TensorImageDataset
    from vitkit.evaluate.loop import batches
    from vitkit.train.objectives import evaluate

    gen = torch.Generator().manual_seed(0)
    model = VisionTransformer(img_size=16, patch_size=8, width=16, depth=1, num_heads=2, mlp_dim=32, num_classes=7)
    torch.nn.init.normal_(model.head.weight, generator=gen)
    images, labels = torch.randn(23, 3, 16, 16, generator=gen), torch.randint(0, 7, (23,), generator=gen)
    model.train()
    with torch.no_grad():  # the independent score: one pass in float64 over the whole set, eval mode by hand
        model.eval()
        logits = model(images).double()
        model.train()
    ce = float(torch.nn.functional.cross_entropy(logits, labels))
    top1 = float((logits.argmax(1) == labels).double().mean())
    top5 = float((logits.topk(5, dim=1).indices == labels[:, None]).any(1).double().mean())
    for data in (
        TensorImageDataset(images, labels),  # sliced
        _Items(images, labels),  # a DataLoader over the items
        torch.utils.data.DataLoader(_Items(images, labels), batch_size=4),  # the caller's loader, as it is
    ):
        got = evaluate(model, data, batch_size=5)
        assert got["eval_images"] == 23 and model.training  # every image once; the model's mode given back
        assert got["eval_loss"] == pytest.approx(ce, rel=1e-5)
        assert (got["eval_top1"], got["eval_top5"]) == (pytest.approx(top1), pytest.approx(top5))
    pairs = list(batches((images, labels), 10))
    assert [len(y) for _, y in pairs] == [10, 10, 3] and torch.equal(torch.cat([x for x, _ in pairs]), images)


class _WorkerItems(torch.utils.data.Dataset):
    """Item i is (image i, the id of the worker that read it)."""

    def __init__(self, images: torch.Tensor) -> None:
        self.images = list(images)  # a list: not the sliced in-memory path

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        info = torch.utils.data.get_worker_info()
        return self.images[i], -1 if info is None else info.id


@pytest.mark.filterwarnings("ignore:This DataLoader will create")  # 3 workers on a 2-core machine
def test_workers_each_load_a_share_of_every_evaluation_batch_and_the_batches_are_the_same():
    from vitkit.evaluate.loop import batches

    images = torch.randn(23, 3, 4, 4)
    alone = list(batches(_WorkerItems(images), 8, dtype=torch.float64))
    assert [len(x) for x, _ in alone] == [8, 8, 7] and all(bool((w == -1).all()) for _, w in alone)
    for workers in (2, 3):
        shared = list(batches(_WorkerItems(images), 8, dtype=torch.float64, num_workers=workers))
        assert [len(x) for x, _ in shared] == [8, 8, 7]
        assert all(torch.equal(a, b) for (a, _), (b, _) in zip(alone, shared, strict=True))
        assert all(x.dtype == torch.float64 for x, _ in shared)
        # chunks of ceil(8 / workers) images in turn: every worker reads part of the first batch
        assert set(shared[0][1].tolist()) == set(range(workers))


def test_the_evaluation_loop_restores_the_model_when_it_fails_and_refuses_an_empty_set():
    from vitkit.errors import UserError
    from vitkit.evaluate.loop import batches, evaluating

    model = torch.nn.Sequential(torch.nn.Dropout(0.5))
    model.train()
    with pytest.raises(RuntimeError, match="forward failed"), evaluating(model):
        assert not model.training and not torch.is_grad_enabled()
        raise RuntimeError("forward failed")
    assert model.training and torch.is_grad_enabled()
    with pytest.raises(UserError, match="empty"):
        list(batches((torch.zeros(0, 3, 4, 4), torch.zeros(0, dtype=torch.long)), 8))
    with pytest.raises(UserError, match="3 images but 2 labels"):
        list(batches((torch.zeros(3, 3, 4, 4), torch.zeros(2, dtype=torch.long)), 8))
