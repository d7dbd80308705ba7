"""Triton's load generator `perf_analyzer`, ready to load-test this server's /v2 infer path with photos.

    python -m mnv3.perf_analyzer_setup [--dir artifacts/perf_analyzer] [--photos 256]

writes DIR/perf_analyzer (the binary behind a wrapper that finds its libraries) and DIR/photos.json
(distinct JPEG photos as the IMAGE input), and prints the command to run, e.g.

    artifacts/perf_analyzer/perf_analyzer -m fp32 -u 127.0.0.1:8000 -i http \\
        --input-data artifacts/perf_analyzer/photos.json --concurrency-range 250

Why it is set up this way: the perf_analyzer binaries in `perf-analyzer` 2.60 and in `tritonclient`
wheels from 2.52 on need glibc 2.38, newer than Debian 12's; the one in `tritonclient==2.51.0` runs,
but that wheel pins numpy<2, so it is downloaded and only the binary taken out of it, never
installed. The binary links `libcudart.so.12` (unpacked from the `nvidia-cuda-runtime-cu12` wheel
the same way; no GPU is used) and libb64 (`apt-get install -y libb64-0d`). perf_analyzer's data file
takes BYTES elements as base64 of what goes on the wire: a uint32 little-endian length, then the bytes.
"""

import argparse
import base64
import ctypes.util
import json
import shutil
import struct
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from mnv3 import cli
from mnv3.artifacts import ARTIFACTS_DIR
from mnv3.photos import load_images
from mnv3.v2_protocol import IMAGE_INPUT

TRITONCLIENT_WHEEL = "tritonclient==2.51.0"  # the newest whose perf_analyzer runs on glibc 2.36
CUDA_RUNTIME_WHEEL = "nvidia-cuda-runtime-cu12"
BINARY_IN_WHEEL = "tritonclient-2.51.0.data/data/bin/perf_analyzer"
CUDA_RUNTIME_IN_WHEEL = "nvidia/cuda_runtime/lib/libcudart.so.12"


class SetupError(RuntimeError):
    """A step that cannot be done here; the message names the fix."""


def download_wheels(directory: Path) -> list[Path]:
    """The two wheels, from the package index, without their dependencies (nothing is installed)."""
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--quiet",
        "--dest",
        str(directory),
        TRITONCLIENT_WHEEL,
        CUDA_RUNTIME_WHEEL,
    ]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        last = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise SetupError(f"pip could not download {TRITONCLIENT_WHEEL} and {CUDA_RUNTIME_WHEEL}: {last}")
    return sorted(directory.glob("*.whl"))


def unpack(wheels: list[Path], member: str, destination: Path) -> Path:
    """Copy `member` out of whichever wheel holds it to `destination` (a file path)."""
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as archive:
            if member in archive.namelist():
                destination.parent.mkdir(parents=True, exist_ok=True)
                with archive.open(member) as source, open(destination, "wb") as target:
                    shutil.copyfileobj(source, target)
                return destination
    raise SetupError(f"{member} is in none of {', '.join(w.name for w in wheels)}")


def write_wrapper(directory: Path, binary: Path, library_dir: Path) -> Path:
    wrapper = directory / "perf_analyzer"
    wrapper.write_text(
        "#!/bin/sh\n"
        f'LD_LIBRARY_PATH="{library_dir.resolve()}${{LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}}" '
        f'exec "{binary.resolve()}" "$@"\n'
    )
    wrapper.chmod(0o755)
    return wrapper


def photos_data(photos: list[bytes]) -> dict:
    """perf_analyzer's --input-data document: one IMAGE element per photo, length-prefixed."""
    return {
        "data": [
            {IMAGE_INPUT: {"b64": base64.b64encode(struct.pack("<I", len(photo)) + photo).decode()}} for photo in photos
        ]
    }


def get_args_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m mnv3.perf_analyzer_setup", description=cli.summary(__doc__))
    parser.add_argument(
        "--dir",
        type=Path,
        default=ARTIFACTS_DIR / "perf_analyzer",
        help="where the binary, its libraries and the data file go [%(default)s]",
    )
    parser.add_argument("--photos", type=int, default=256, help="distinct photos in the data file [%(default)s]")
    return parser


def main(args) -> None:
    if args.photos < 1:
        raise SetupError("--photos must be at least 1")
    if ctypes.util.find_library("b64") is None:
        raise SetupError("perf_analyzer needs libb64: run apt-get install -y libb64-0d (Debian/Ubuntu)")
    directory = args.dir
    with tempfile.TemporaryDirectory() as downloads:
        wheels = download_wheels(Path(downloads))
        binary = unpack(wheels, BINARY_IN_WHEEL, directory / "bin" / "perf_analyzer")
        binary.chmod(0o755)
        unpack(wheels, CUDA_RUNTIME_IN_WHEEL, directory / "lib" / Path(CUDA_RUNTIME_IN_WHEEL).name)
    wrapper = write_wrapper(directory, binary, directory / "lib")
    check = subprocess.run([str(wrapper), "--version"], capture_output=True, text=True)
    if check.returncode != 0:  # a missing library or too old a glibc
        last = (check.stderr.strip().splitlines() or ["no output"])[-1]
        raise SetupError(f"{wrapper} does not run here: {last}")
    data = directory / "photos.json"
    data.write_text(json.dumps(photos_data(load_images(args.photos))))
    print(
        f"wrote {wrapper} and {data} ({args.photos} photos). Against a running server:\n"
        f"  {wrapper} -m MODEL -u 127.0.0.1:PORT -i http --input-data {data} --concurrency-range 250 [--async]"
    )


if __name__ == "__main__":
    try:
        main(get_args_parser().parse_args())
    except SetupError as exc:
        print(f"mnv3.perf_analyzer_setup: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
