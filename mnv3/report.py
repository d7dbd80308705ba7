"""CSV writing, the machine/version record, and results/summary.md regenerated from every CSV present."""
import csv
import os
import platform
from importlib import metadata
from pathlib import Path

LIBRARIES = ("torch", "torchvision", "onnx", "onnxruntime", "openvino", "numpy", "pillow", "fastapi", "uvicorn")


def cpu_info() -> dict:
    model, flags = platform.processor() or "unknown", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    except OSError:
        pass
    interesting = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8", "amx_bf16", "avx512_bf16")
    return {"cpu": model, "cores": os.cpu_count(), "isa": " ".join(f for f in interesting if f in flags) or "none"}


def library_versions() -> dict:
    versions = {}
    for name in LIBRARIES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return versions


def write_csv(path, rows: list[dict]) -> Path:
    """Write rows (dicts; the union of their keys, in first-seen order, is the header)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    header = list(dict.fromkeys(key for row in rows for key in row))
    tmp = path.with_suffix(".tmp")
    with tmp.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=header)
        writer.writeheader()
        writer.writerows(rows)
    tmp.replace(path)
    return path


def read_csv(path) -> list[dict]:
    with Path(path).open(newline="") as f:
        return list(csv.DictReader(f))
