"""How close a variant's predictions are to FP32 on held-out photos, and true accuracy given --labels.

Agreement needs no labels, so it is meaningful even for the random-init stand-in: top-1 agreement is
the share of images whose predicted class matches FP32's, top-5 agreement the share whose FP32 class
is among the variant's top 5, and SQNR = 10*log10(sum(ref^2) / sum((ref - x)^2)) over all logits.
"""

import csv
from pathlib import Path

import numpy as np

from mnv3.photos import IMAGE_SUFFIXES, held_out_images, list_images, spread
from mnv3.preprocess import DEFAULT_PREPROCESSING, InvalidImage, Preprocessing, preprocess_batch, preprocess_files


class UnreadableLabels(ValueError):
    """--labels is missing, empty, or names images/classes that cannot be used."""


def held_out_batch(
    count: int,
    preprocessing: Preprocessing = DEFAULT_PREPROCESSING,
    labelled: tuple[list[Path], np.ndarray] | None = None,
) -> np.ndarray:
    """`count` preprocessed held-out photos: what every stage compares variants on (never calibration photos).

    Views of the sample photos, or with `labelled` (--labels: the user's photos of the model's classes) up to
    `count` of those, spread evenly over them. Why: agreement with FP32 and SQNR measure a model's INT8 error on
    the inputs it will see, and the sample photos can lie far outside a fine-tune's classes (a 3-class model's
    logits ran ~10x larger on them than on its own photos), where its INT8 error says little about its own
    photos; stage 2's agreement guard decides which engine serves by these numbers."""
    if labelled is None:
        return preprocess_batch(held_out_images(count), preprocessing)
    paths = spread(labelled[0], count)
    return next(path_batches(paths, len(paths), preprocessing))  # all in one batch: an unreadable one is named


def predict(run, batches) -> np.ndarray:
    return np.concatenate([run(batch) for batch in batches])


def array_batches(images: np.ndarray, batch_size: int):
    return (images[i : i + batch_size] for i in range(0, len(images), batch_size))


def path_batches(paths, batch_size: int, preprocessing: Preprocessing = DEFAULT_PREPROCESSING):
    for i in range(0, len(paths), batch_size):
        try:
            yield preprocess_files(paths[i : i + batch_size], preprocessing)
        except InvalidImage as exc:
            raise UnreadableLabels(f"labelled image {exc}") from exc


def top_k(logits: np.ndarray, k: int) -> np.ndarray:
    return np.argsort(-logits, axis=1)[:, :k]


def sqnr_db(reference: np.ndarray, logits: np.ndarray) -> float:
    reference = reference.astype(np.float64)
    with np.errstate(divide="ignore"):  # identical logits: infinite SQNR, not a warning
        return float(10 * np.log10(np.sum(reference**2) / np.sum((reference - logits) ** 2)))


def agreement(reference: np.ndarray, logits: np.ndarray) -> dict:
    reference_top1 = reference.argmax(axis=1)
    return {
        "top1_agreement": round(float(np.mean(logits.argmax(axis=1) == reference_top1)), 4),
        "top5_agreement": round(float(np.mean((top_k(logits, 5) == reference_top1[:, None]).any(axis=1))), 4),
        "sqnr_db": round(sqnr_db(reference, logits), 2),
    }


def true_accuracy(logits: np.ndarray, labels: np.ndarray) -> dict:
    return {
        "top1_accuracy": round(float(np.mean(logits.argmax(axis=1) == labels)), 4),
        "top5_accuracy": round(float(np.mean((top_k(logits, 5) == labels[:, None]).any(axis=1))), 4),
    }


def evaluate(
    run,
    held_out: np.ndarray,
    reference=None,
    labelled=None,
    batch_size: int = 32,
    preprocessing: Preprocessing = DEFAULT_PREPROCESSING,
) -> dict:
    """Agreement with `reference` logits on `held_out`, plus true accuracy on `labelled` (paths, labels),
    whose images are preprocessed as the model's `preprocessing` says."""
    row: dict = {}
    if reference is not None:
        row |= agreement(reference, predict(run, array_batches(held_out, batch_size)))
    if labelled is not None:
        paths, labels = labelled
        row |= true_accuracy(predict(run, path_batches(paths, batch_size, preprocessing)), labels)
    return row


def load_labels(path, class_names: list[str]) -> tuple[list[Path], np.ndarray]:
    """(image paths, class ids of the model's `class_names`) from a folder-per-class tree or a CSV of file,class_id.

    Class folders are named by their class names ("golden retriever"), or their class ids ("207"), or, when
    there is one folder per class, by anything that sorts in class order (the wnids of ILSVRC val, or the
    training folders torchvision's ImageFolder sorted into class ids): one rule for all (`_folder_pairs`).
    CSV paths are relative to the CSV; a header row is optional.
    """
    path = Path(path)
    if path.is_dir():
        pairs = _folder_pairs(path, class_names)
    elif path.is_file() and path.suffix.lower() == ".csv":
        pairs = _csv_pairs(path)
    elif not path.exists():
        raise UnreadableLabels(f"--labels {path}: no such file or folder")
    else:
        raise UnreadableLabels(f"--labels {path}: expected a folder of class folders or a .csv of file,class_id")
    if not pairs:
        raise UnreadableLabels(f"--labels {path}: no labelled images found")
    for image_path, class_id in pairs:
        if not image_path.is_file():
            raise UnreadableLabels(f"--labels {path}: image {image_path} does not exist")
        if not 0 <= class_id < len(class_names):
            raise UnreadableLabels(f"--labels {path}: class id {class_id} outside 0..{len(class_names) - 1}")
    return [p for p, _ in pairs], np.array([c for _, c in pairs])


def _folder_pairs(root: Path, class_names: list[str]) -> list[tuple[Path, int]]:
    """Every folder is matched by one rule, the first that matches them all: their names are class names (as
    written, else ignoring case where that is unambiguous), or class ids, or, with one folder per class, their
    sorted order (as ImageFolder numbers them), unless that gives a folder named as a class another class (one
    class name mistyped shifts every folder after it). A folder's images include those in folders within it."""
    folders = sorted(p for p in root.iterdir() if p.is_dir())
    names = [folder.name for folder in folders]
    by_name = _class_ids_named(names, class_names)
    misplaced = [(i, named) for i, named in enumerate(by_name) if named not in (None, i)]
    if None not in by_name:
        ids = [named for named in by_name if named is not None]  # all of them
    elif all(name.isdigit() and int(name) < len(class_names) for name in names):
        ids = [int(name) for name in names]
    elif len(folders) == len(class_names) and not misplaced:
        ids = list(range(len(folders)))
    else:
        unmatched = [name for name, named in zip(names, by_name, strict=True) if named is None][:3]
        why = f"there are {len(folders)} folders for {len(class_names)} classes"
        if len(folders) == len(class_names):
            i, named = misplaced[0]
            why = (
                f"by their sorted order (one folder per class) folder {names[i]!r} would be labelled class {i} "
                f"({class_names[i]!r}), not class {named}, whose name it has"
            )
        raise UnreadableLabels(
            f"--labels {root}: folders such as {', '.join(map(repr, unmatched))} are neither class names nor class "
            f"ids, and {why}: name each folder by its class name or id"
        )
    return [
        (image, class_id)
        for folder, class_id in zip(folders, ids, strict=True)
        for image in list_images(folder, recursive=True)
    ]


def _class_ids_named(names: list[str], class_names: list[str]) -> list[int | None]:
    """The class id each of `names` is the name of (as written, else ignoring case where that is unambiguous),
    None for one that names no class."""
    exact = {name: i for i, name in enumerate(class_names)}
    folded = {name.casefold(): i for i, name in enumerate(class_names)}
    if len(folded) < len(class_names):  # two classes differ only in case: a folder must name one as written
        folded = {}
    return [exact.get(name, folded.get(name.casefold())) for name in names]


def spread_labelled(labelled: tuple[list[Path], np.ndarray], count: int | None) -> tuple[list[Path], np.ndarray]:
    """`count` of the labelled photos (all without it), spread evenly over them: a folder per class keeps every
    class's share. Every variant scores every labelled photo, so a 50,000-photo validation set costs hours."""
    paths, labels = labelled
    kept = spread(list(range(len(paths))), count or len(paths))
    return [paths[i] for i in kept], labels[kept]


def labelled_summary(
    path, labelled: tuple[list[Path], np.ndarray], scored: tuple[list[Path], np.ndarray], held_out_count: int
) -> str:
    """What accuracy is scored on (`scored`, the `labelled` photos spread_labelled kept), and agreement with
    FP32 (held_out_batch's `count` of them), for a stage to print."""
    paths, labels = labelled
    kept = len(scored[0])
    return (
        f"labelled photos: {len(paths)} in {len(set(labels.tolist()))} classes from {path}; "
        + (f"accuracy on {kept} of them (--labels-count), " if kept < len(paths) else "")
        + f"agreement with FP32 on {min(held_out_count, kept)} of them"
    )


def _csv_pairs(csv_path: Path) -> list[tuple[Path, int]]:
    try:
        with csv_path.open(newline="", encoding="utf-8-sig") as f:  # with or without a byte-order mark
            rows = list(csv.reader(f))
    except (UnicodeDecodeError, csv.Error) as exc:
        raise UnreadableLabels(f"--labels {csv_path}: not a readable CSV ({exc})") from exc
    pairs = []
    for line_number, row in enumerate(rows, start=1):
        if not row or (line_number == 1 and not row[-1].strip().isdigit()):
            continue  # blank line or header
        if len(row) != 2 or not row[1].strip().isdigit():
            raise UnreadableLabels(f"--labels {csv_path} line {line_number}: expected file,class_id, got {row}")
        image_path = csv_path.parent / row[0].strip()
        if image_path.suffix.lower() not in IMAGE_SUFFIXES:
            raise UnreadableLabels(f"--labels {csv_path} line {line_number}: {row[0]} is not an image file")
        pairs.append((image_path, int(row[1])))
    return pairs
