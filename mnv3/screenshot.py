"""The README's pictures of the page, made by a command, not by hand:

    python -m mnv3.screenshot [results/page.png] [--narrow-output results/page_narrow.png] [--model SPEC ...]

Starts its own server on a free 127.0.0.1 port with the models given (by default FP32 and static INT8,
from stages 1 and 2), opens the page in headless Chromium (`mnv3.browser`: nothing may leave the host,
and the command fails if the page tried), turns compare mode on when there are several models, chooses
a few of the sample photos that scikit-image and matplotlib ship, waits for their answers and for the
live panel, saves the page at a desktop width and at a phone width, and stops the server.
"""

import argparse
import sys
import time
from pathlib import Path

from mnv3.artifacts import ARTIFACTS_DIR, FP32_ONNX, RESULTS_DIR, STATIC_INT8_ONNX, MissingArtifact, require
from mnv3.browser import ChromiumMissing, local_browser
from mnv3.config import ModelSpec
from mnv3.loadtest import ServerProcess
from mnv3.photos import encode_jpeg, source_photos

PHOTOS = (
    ("skimage", "data/chelsea.png"),
    ("skimage", "data/coffee.png"),
    ("matplotlib", "mpl-data/sample_data/grace_hopper.jpg"),
)
WIDE = {"width": 1280, "height": 900}
NARROW = {"width": 390, "height": 844}  # a phone
WAIT_MS = 60_000
DEFAULT_MODELS = ((ARTIFACTS_DIR / FP32_ONNX, 1), (ARTIFACTS_DIR / STATIC_INT8_ONNX, 2))  # (file, stage writing it)


def get_args_parser(add_help=True) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m mnv3.screenshot",
        add_help=add_help,
        description="Screenshot the page served at / (wide and narrow) with a few "
        "photos classified, from a server this command starts and stops.",
    )
    parser.add_argument(
        "output",
        nargs="?",
        type=Path,
        default=RESULTS_DIR / "page.png",
        help="the wide screenshot (default %(default)s)",
    )
    parser.add_argument(
        "--narrow-output",
        type=Path,
        default=RESULTS_DIR / "page_narrow.png",
        help=f"the first screen at a phone's size, {NARROW['width']}x{NARROW['height']} px (default %(default)s)",
    )
    parser.add_argument(
        "--model",
        action="append",
        metavar="[NAME=]PATH[@BACKEND]",
        help="a model to serve, as the server's --model takes it; repeat it for several (the "
        "page then shows them side by side). Default: "
        + " and ".join(str(path) for path, _ in DEFAULT_MODELS)
        + ", written by stages 1 and 2, both on onnxruntime",
    )
    return parser


def photo_files() -> list[dict]:
    return [
        {"name": Path(path).with_suffix(".jpg").name, "mimeType": "image/jpeg", "buffer": encode_jpeg(photo)}
        for (_, path), photo in zip(PHOTOS, source_photos(PHOTOS), strict=True)
    ]


def take(page, path: Path, viewport: dict, full_page: bool) -> None:
    page.set_viewport_size(viewport)
    page.wait_for_timeout(300)  # the layout settles after the resize
    path.parent.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=path, full_page=full_page)
    print(f"wrote {path} ({viewport['width']} px wide)")


def served_models(args) -> list[str]:
    """The --model specs, each file checked to exist (a missing default names the stage that writes it)."""
    if not args.model:
        # On onnxruntime both: --backend auto could serve the one engine stage 2 chose for both files.
        return [f"{require(path, stage)}@onnxruntime" for path, stage in DEFAULT_MODELS]
    for spec in map(ModelSpec.parse, args.model):
        if not spec.path.exists():
            raise MissingArtifact(f"{spec.path} not found: check --model")
    return args.model


def main(args) -> None:
    try:
        models = served_models(args)
        with ServerProcess(models[0], extra_models=tuple(models[1:])) as url, local_browser(**WIDE) as browser:
            page = browser.context.new_page()
            page.set_default_timeout(WAIT_MS)
            page.goto(url + "/")
            if len(models) > 1:
                page.locator("#model-choice").wait_for()  # shown once GET /models has answered
                page.get_by_label("Compare all models").check()
            files = photo_files()
            page.locator("#file-input").set_input_files(files)
            answers = len(files) * len(models)
            page.wait_for_function(
                f"() => document.querySelectorAll('#photos .top5, #photos .error').length >= {answers}"
            )
            page.wait_for_function(f"() => Number(document.getElementById('stat-requests').textContent) >= {answers}")
            time.sleep(1.6)  # one more refresh of the live panel, so its history line has two points
            take(page, args.output, WIDE, full_page=True)
            take(page, args.narrow_output, NARROW, full_page=False)  # what a phone shows first
            if browser.off_host:
                raise SystemExit(f"mnv3.screenshot: error: the page tried to load from other hosts: {browser.off_host}")
    except (MissingArtifact, ChromiumMissing) as exc:
        print(f"mnv3.screenshot: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main(get_args_parser().parse_args())
