"""WebDataset shards through the ``webdataset`` library: ``--data wds:WHERE`` (data.source=wds, data.root=WHERE).

WHERE is a directory written by ``vitkit shard`` (its manifest.json counts the samples), or a shard pattern
(``train-{000000..000127}.tar``, counted at start-up) of ``KEY.png|jpg|jpeg|webp`` and ``KEY.cls`` samples. Epoch e
reads the shards in a permutation drawn from (seed, e); its first ``steps_per_epoch * batch_size`` samples are cut into
one block per rank, shuffled in a buffer seeded by (seed, e, rank), and the micro-batches dealt to the workers in turn:
every sample is seen once an epoch, whatever the number of workers. The order is a function of
(seed, epoch, world size), so a resumed run replays its epoch's stream up to its step without decoding it, and
continues exactly where it was (with the same world size).
"""

from __future__ import annotations

import glob
import hashlib
import io
import json
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from ..errors import UserError, UserFileNotFoundError
from ..optional import require

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = "vitkit-shards"
IMAGE_KEYS = ("png", "jpg", "jpeg", "webp")
Transform = Callable[[Image.Image], torch.Tensor]
Sample = dict[str, Any]


def mix(*parts: int) -> int:
    """A well-spread 63-bit seed from a tuple of ints (as vitkit.train.sampling.mix_seed, with its own tag)."""
    digest = hashlib.blake2b(("wds," + ",".join(str(int(p)) for p in parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


# ------------------------------------------------------------------------------------------------ shard lists
@dataclass(frozen=True)
class Shards:
    """Shard files with their sample counts, and the class names when a manifest gives them."""

    paths: list[str]
    counts: list[int]
    class_names: list[str] | None

    @property
    def total(self) -> int:
        return sum(self.counts)


def read_shard_manifest(path: str | Path) -> dict[str, Any]:
    """The manifest.json ``vitkit shard`` writes beside its shards (their splits, names, counts and classes)."""
    path = Path(path)
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise UserError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(doc, dict) or doc.get("format") != MANIFEST_FORMAT or not isinstance(doc.get("splits"), dict):
        raise UserError(f"{path}: not a shard manifest (expected a JSON object with format {MANIFEST_FORMAT!r})")
    return doc


def expand_pattern(pattern: str) -> list[str]:
    """Brace and glob patterns (webdataset's ``expand_urls``) -> existing local shard files, in pattern order."""
    wds = require("webdataset", "data.source=wds")
    paths: list[str] = []
    for item in wds.shardlists.expand_urls(pattern):
        paths += sorted(glob.glob(item)) if any(c in item for c in "*?[") else [item]
    missing = [p for p in paths if not Path(p).is_file()]
    if not paths or missing:
        shown = ", ".join(missing[:3]) or pattern
        raise UserFileNotFoundError(f"data.root={pattern!r}: shard files not found: {shown}")
    return paths


def find_shards(where: str, split: str = "train") -> Shards | None:
    """The shards of ``split`` that WHERE names, counted; None for a shard directory without that split."""
    if Path(where).is_dir():
        manifest = Path(where) / MANIFEST_NAME
        if not manifest.is_file():
            raise UserFileNotFoundError(
                f"data.root={where!r}: a directory without {MANIFEST_NAME}; give a shard pattern"
            )
        doc = read_shard_manifest(manifest)
        part = doc["splits"].get(split)
        if part is None:
            return None
        paths = [str(Path(where) / s["name"]) for s in part["shards"]]
        missing = [p for p in paths if not Path(p).is_file()]
        if missing:
            raise UserFileNotFoundError(f"{manifest}: shard files not found: {', '.join(missing[:3])}")
        return Shards(paths, [int(s["count"]) for s in part["shards"]], list(doc["classes"]))
    paths = expand_pattern(where)
    known = _manifest_counts(paths)
    if known is not None:
        return Shards(paths, known[0], known[1])
    counts, found, top = [], set(), (-1, "")
    for path in paths:  # one pass reading every shard (the class entries only are parsed)
        labels = [int(s["cls"]) for s in read_shard(path) if "cls" in s]
        counts.append(len(labels))
        found.update(labels)
        if labels and min(labels) < 0:
            raise UserError(f"{path}: a sample has cls {min(labels)}, expected a class index from 0")
        top = max([top, *((k, path) for k in labels)])
    print(f"wds: counted {sum(counts)} samples in {len(paths)} shards (no {MANIFEST_NAME} beside them)", flush=True)
    if split == "train" and len(found) < top[0] + 1:  # a stray label is no new class
        raise UserError(
            f"{top[1]}: a sample has cls {top[0]}, but only {len(found)} of the {top[0] + 1} classes 0..{top[0]} have "
            "samples in the training shards; cls is a class index 0..K-1"
        )
    return Shards(paths, counts, [str(k) for k in range(top[0] + 1)])


def _manifest_counts(paths: Sequence[str]) -> tuple[list[int], list[str]] | None:
    """Counts and classes of these shards from a manifest.json in their directory, if it lists every one."""
    folders = {Path(p).resolve().parent for p in paths}
    if len(folders) != 1 or not (next(iter(folders)) / MANIFEST_NAME).is_file():
        return None
    doc = read_shard_manifest(next(iter(folders)) / MANIFEST_NAME)
    counts = {s["name"]: int(s["count"]) for part in doc["splits"].values() for s in part["shards"]}
    if not all(Path(p).name in counts for p in paths):
        return None
    return [counts[Path(p).name] for p in paths], list(doc["classes"])


# -------------------------------------------------------------------------------------------------- samples
def read_shard(path: str) -> Iterator[Sample]:
    """The samples of one shard file ({"__key__": ..., "png": bytes, "cls": bytes, ...}) in file order."""
    wds = require("webdataset", "data.source=wds")
    yield from wds.tariterators.tarfile_samples([{"url": path}])


def counted(path: str, count: int) -> Iterator[Sample]:
    """read_shard's samples, checked against the count the shard's manifest gives (read to its end: all of them)."""
    seen = 0
    for seen, sample in enumerate(read_shard(path), start=1):
        if seen > count:
            break
        yield sample
    if seen != count:
        more = "more than" if seen > count else f"{seen}, not"
        raise UserError(
            f"{path}: holds {more} the {count} samples its manifest gives; shard again, or remove the manifest to count"
        )


def decode(sample: Sample, num_classes: int | None = None) -> tuple[Image.Image, int]:
    """(image, class index) of a raw sample, the image opened but not decoded; the index checked against
    num_classes."""
    image_key = next((k for k in IMAGE_KEYS if k in sample), None)
    if image_key is None or "cls" not in sample:
        raise UserError(
            f"{sample.get('__url__')}: sample {sample.get('__key__')!r} needs an image ({'/'.join(IMAGE_KEYS)}) "
            f"and a cls entry, has {sorted(k for k in sample if not k.startswith('__'))}"
        )
    try:  # the header now; the pixels when the transform decodes them (see ``transformed``)
        image = Image.open(io.BytesIO(sample[image_key]))
        label = int(sample["cls"].decode() if isinstance(sample["cls"], bytes) else sample["cls"])
    except (OSError, ValueError, SyntaxError) as e:
        raise UserError(f"{sample.get('__url__')}: cannot read sample {sample.get('__key__')!r} ({e})") from None
    if label < 0 or (num_classes is not None and label >= num_classes):
        classes = f"from 0 to {num_classes - 1}" if num_classes is not None else "from 0"
        where = f"{sample.get('__url__')}: sample {sample.get('__key__')!r}"
        raise UserError(f"{where} has cls {label}, expected a class index {classes}")
    return image, label


def transformed(transform: Transform, image: Image.Image, sample: Sample) -> torch.Tensor:
    """The transform of a sample's image; a file that fails to decode is a UserError naming the sample."""
    try:
        return transform(image)
    except UserError as e:
        raise UserError(f"{sample.get('__url__')}: cannot read sample {sample.get('__key__')!r} ({e})") from None


def shuffled(samples: Iterator[Sample], size: int, rng: random.Random) -> Iterator[Sample]:
    """A streaming shuffle: hold ``size`` samples, emit a random one as each new one arrives, then drain."""
    buffer: list[Sample] = []
    for sample in samples:
        if len(buffer) < size:
            buffer.append(sample)
            continue
        i = rng.randrange(size)
        buffer[i], sample = sample, buffer[i]
        yield sample
    rng.shuffle(buffer)
    yield from buffer


class WebDatasetStream(IterableDataset):
    """Training shards as a stream, read by ``batches()``; iterating yields every sample in shard order."""

    def __init__(
        self, shards: Shards, transform: Transform, shuffle_buffer: int = 1000, num_classes: int | None = None
    ) -> None:
        self.shards, self.transform, self.shuffle_buffer = shards, transform, shuffle_buffer
        self.num_classes = num_classes
        self.num_skipped = 0
        self.record_keys: list[str] | None = None  # when a list: keys of the samples this process decodes

    def __len__(self) -> int:
        return self.shards.total

    def __iter__(self) -> Iterator[tuple[torch.Tensor, int]]:
        for path, count in zip(self.shards.paths, self.shards.counts):
            for sample in counted(path, count):
                image, label = decode(sample, self.num_classes)
                yield transformed(self.transform, image, sample), label

    def block(self, epoch: int, seed: int, start: int, stop: int) -> Iterator[Sample]:
        """Samples [start, stop) of epoch ``epoch``'s shard order, opening only the shards they lie in."""
        order = torch.randperm(len(self.shards.paths), generator=torch.Generator().manual_seed(mix(seed, epoch)))
        offset = 0
        for i in order.tolist():
            count = self.shards.counts[i]
            if offset + count > start and offset < stop:
                for j, sample in enumerate(counted(self.shards.paths[i], count)):
                    if start <= offset + j < stop:
                        yield sample
            offset += count
            if offset >= stop:
                return

    def batches(
        self,
        *,
        batch_size: int,
        accum_steps: int,
        world_size: int,
        rank: int,
        seed: int,
        start_step: int,
        total_steps: int,
        num_workers: int = 0,
        pin_memory: bool = False,
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's micro-batches (images, labels) for steps [start_step, total_steps), through a DataLoader."""
        plan = _Plan(self, batch_size, accum_steps, world_size, rank, seed, start_step, total_steps)
        if plan.steps_per_epoch < 1:
            raise UserError(f"the shards hold {len(self)} samples, fewer than one batch ({batch_size})")
        skipped = (start_step % plan.steps_per_epoch) * accum_steps * plan.per_rank
        if skipped:
            print(
                f"wds: resuming at step {start_step}: replaying epoch {start_step // plan.steps_per_epoch}'s stream "
                f"and skipping {skipped} samples of this rank without decoding them (exact for the same world size "
                f"{world_size}; a different world size continues with its own order from this point)",
                flush=True,
            )
        loader = DataLoader(plan, batch_size=None, num_workers=num_workers, pin_memory=pin_memory)
        yield from loader


@dataclass
class _Plan(IterableDataset):
    """One rank's stream of micro-batches; worker w of K decodes the micro-batches g with g % K == w."""

    stream: WebDatasetStream
    batch_size: int
    accum_steps: int
    world_size: int
    rank: int
    seed: int
    start_step: int
    total_steps: int

    def __post_init__(self) -> None:
        self.steps_per_epoch = len(self.stream) // self.batch_size
        self.per_rank = self.batch_size // self.accum_steps // self.world_size  # items of one micro-batch on one rank
        self.block_size = self.steps_per_epoch * self.batch_size // self.world_size  # items of one epoch on one rank

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        g = 0  # micro-batches dealt since the start step, over all workers
        for epoch in range(self.start_step // self.steps_per_epoch, -(-self.total_steps // self.steps_per_epoch)):
            first = max(self.start_step, epoch * self.steps_per_epoch) - epoch * self.steps_per_epoch
            last = min(self.total_steps, (epoch + 1) * self.steps_per_epoch) - epoch * self.steps_per_epoch
            begin, end = first * self.accum_steps, last * self.accum_steps  # micro-batches of this epoch to deal
            start = self.rank * self.block_size
            rng = random.Random(mix(self.seed, epoch, self.rank, 0x5B))
            samples = shuffled(
                self.stream.block(epoch, self.seed, start, start + self.block_size), self.stream.shuffle_buffer, rng
            )
            batch: list[Sample] = []
            for position, sample in enumerate(samples):
                micro = position // self.per_rank
                if micro >= end:
                    break
                if micro < begin or (g + micro - begin) % workers != worker:
                    continue
                batch.append(sample)
                if len(batch) == self.per_rank:
                    yield self._collate(batch, epoch, micro)
                    batch = []
            g += end - begin

    def _collate(self, batch: list[Sample], epoch: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        images, labels = [], []
        for i, sample in enumerate(batch):
            image, label = decode(sample, self.stream.num_classes)
            torch.manual_seed(mix(self.seed, epoch, self.rank, micro * self.per_rank + i))  # the augmentation
            images.append(transformed(self.stream.transform, image, sample))
            labels.append(label)
            if self.stream.record_keys is not None:
                self.stream.record_keys.append(str(sample["__key__"]))
        return torch.stack(images), torch.tensor(labels, dtype=torch.long)


class WebDatasetItems(IterableDataset):
    """Evaluation shards in order, as (image tensor, label) items; DataLoader workers take shards in turn."""

    def __init__(self, shards: Shards, transform: Transform, num_classes: int | None = None) -> None:
        self.shards, self.transform, self.num_classes = shards, transform, num_classes
        self.num_skipped = 0

    def __len__(self) -> int:
        return self.shards.total

    def __iter__(self) -> Iterator[tuple[torch.Tensor, int]]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        shards = list(zip(self.shards.paths, self.shards.counts))
        for path, count in shards[worker::workers]:
            for sample in counted(path, count):
                image, label = decode(sample, self.num_classes)
                yield transformed(self.transform, image, sample), label


def build_wds_parts(
    where: str, val_root: str | None, shuffle_buffer: int, train_tf: Transform, eval_tf: Transform
) -> tuple[WebDatasetStream, WebDatasetItems, list[str]]:
    """(training stream, evaluation items, class names) of ``wds:WHERE`` (module docstring)."""
    train = find_shards(where, "train")
    if train is None:
        raise UserError(f"data.root={where!r}: the manifest has no train split")
    held = find_shards(val_root, "val") if val_root else None
    if held is None and Path(where).is_dir():
        held = find_shards(where, "val")
    if held is None:
        raise UserError(
            f"data.root={where!r}: no evaluation shards; set data.val_root=PATTERN (or shard with a val split)"
        )
    names = train.class_names or held.class_names or []
    if held.class_names and len(held.class_names) > len(names):  # counted shards: classes 0..the largest label
        names = held.class_names
    classes = len(names) or None
    return WebDatasetStream(train, train_tf, shuffle_buffer, classes), WebDatasetItems(held, eval_tf, classes), names
