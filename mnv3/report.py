"""CSV writing, the machine/version record, and results/summary.md regenerated from every CSV present."""

import csv
import io
import os
import platform
from importlib import metadata
from pathlib import Path

from mnv3.artifacts import (
    BASELINE_CSV,
    GOALS_CSV,
    RESULTS_DIR,
    STAND_IN_PROVENANCE,
    TRANSFORMER_CONTROL_CSV,
    write_atomically,
)

LIBRARIES = ("torch", "torchvision", "onnx", "onnxruntime", "openvino", "numpy", "pillow", "fastapi", "uvicorn")


UNKNOWN_CPU = "unknown"  # cpu_info's name for a CPU that neither /proc/cpuinfo nor platform names (aarch64 Linux)


def cpu_info() -> dict:
    model, flags = platform.processor() or UNKNOWN_CPU, set()
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


def machine_columns() -> dict:
    """Where a row was measured, as every stage's rows record it: the CPU, and the libraries' versions."""
    return cpu_info() | {f"{name}_version": version for name, version in library_versions().items()}


def library_versions() -> dict:
    versions = {"python": platform.python_version()}
    for name in LIBRARIES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return versions


def write_csv(path, rows: list[dict]) -> Path:
    """Write rows (dicts; the union of their keys, in first-seen order, is the header)."""
    header = list(dict.fromkeys(key for row in rows for key in row))
    text = io.StringIO(newline="")
    writer = csv.DictWriter(text, fieldnames=header)
    writer.writeheader()
    writer.writerows(rows)
    return write_atomically(Path(path), text.getvalue())


def read_csv(path) -> list[dict]:
    with Path(path).open(newline="") as f:
        return list(csv.DictReader(f))


def markdown_table(rows: list[dict]) -> str:
    if not rows:
        return "(empty)"
    header = list(rows[0])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(row.get(key, "")).replace("|", "\\|") for key in header) + " |" for row in rows]
    return "\n".join(lines)


# What names the model a row measured; a table has those of them its stage knows. `model_id` (artifacts.model_id)
# tells apart two models the others do not: the same weights with another preprocessing, say.
MODEL_COLUMNS = ("weights", "arch", "classes", "model_id")
CONTROL_TABLES = (TRANSFORMER_CONTROL_CSV,)  # of another model by design


def row_model(row: dict) -> dict:
    """The model `row` measured: those of its MODEL_COLUMNS it fills, as text (as a CSV holds them)."""
    return {key: str(row[key]) for key in MODEL_COLUMNS if row.get(key) not in (None, "")}


def model_named(model: dict) -> str:
    """`model` (as row_model gives it) in words: "weights random-init, arch mobilenet_v3_large, ..."."""
    return ", ".join(f"{key} {value}" for key, value in model.items())


def stage_1_model(results_dir) -> dict:
    """The model stage 1 last measured in `results_dir` (`row_model` of its first row), {} without its table."""
    path = Path(results_dir) / BASELINE_CSV
    rows = read_csv(path) if path.exists() else []
    return row_model(rows[0]) if rows else {}


def of_model(row: dict, model: dict) -> bool:
    """Whether `row` measured `model` as far as both say (a row or a model that names nothing matches): by
    model_id where both have one (see same_model), else by every column."""
    if row.get("model_id") and model.get("model_id"):
        return str(row["model_id"]) == str(model["model_id"])
    return all(row.get(key) in (None, "", value) for key, value in model.items())


def same_model(a: dict, b: dict) -> bool:
    """Whether two models (as row_model gives them) are one: by model_id where both have one, the export's and
    preprocessing's hash (the same tensors saved in two files are one model, whose weights columns name two
    files); else only if every column is the same."""
    if a.get("model_id") and b.get("model_id"):
        return a["model_id"] == b["model_id"]
    return a == b


def write_summary(results_dir=RESULTS_DIR) -> Path:
    """Regenerate results_dir/summary.md from every CSV and PNG there, one section per file stem.

    Any stage may add `NN_name.csv` / `NN_name.png`; sections follow file-name order, a PNG sits
    under the CSV of the same stem. A `weights` (provenance) column in any CSV is summarised up top.
    """
    results_dir = Path(results_dir)
    stems = sorted({p.stem for p in results_dir.glob("*.csv")} | {p.stem for p in results_dir.glob("*.png")})
    tables = {stem: read_csv(results_dir / f"{stem}.csv") for stem in stems if (results_dir / f"{stem}.csv").exists()}
    provenances = sorted({row["weights"] for rows in tables.values() for row in rows if row.get("weights")})
    # Stages record the machine and versions in every row. The header states what the rows record alike (not
    # the machine writing the summary, which may have measured none of them), and columns that only repeat it
    # go, so a table measured elsewhere (results copied from another machine) keeps its own.
    header_facts = recorded_alike(tables.values())
    libraries = [f"{name} {header_facts[f'{name}_version']}" for name in VERSIONED if f"{name}_version" in header_facts]
    differ = [
        name
        for name in VERSIONED
        if f"{name}_version" not in header_facts
        and any(row.get(f"{name}_version") for t in tables.values() for row in t)
    ]
    if differ:  # not one version in every table: each table keeps its column
        libraries.append(f"{', '.join(differ)}: not the same in every table (see their version columns)")
    # Profiles and goals come of their stage's main tables, which record the machine for them.
    unrecorded = [
        stem
        for stem, rows in tables.items()
        if rows and not any(row.get("cpu") for row in rows) and not stem.endswith("_profile") and stem != GOALS_STEM
    ]
    lines = [
        "# mnv3 results",
        "",
        "Regenerated by every stage from the CSVs and plots in this folder; do not edit by hand.",
        "",
        f"- Machine: {_machine_line(header_facts, tables.values())}",
        f"- Libraries: {'; '.join(libraries) or 'not recorded in these tables'}",
        f"- Weights: {', '.join(provenances) or 'not recorded'}",
    ]
    if unrecorded:
        lines.append(f"- Not recorded where they were measured (written before rows said so): {', '.join(unrecorded)}")
    if STAND_IN_PROVENANCE in provenances:
        lines.append(
            "- **WARNING: random-init weights** (ImageNet weights were unavailable): BatchNorm statistics "
            "were re-estimated on calibration-source photos so activations are realistic. Latency, size "
            "and INT8-vs-FP32 agreement are meaningful; predicted labels are not."
        )
    model = stage_1_model(results_dir)
    for stem in stems:
        lines += ["", f"## {stem}", ""]
        control = f"{stem}.csv" in CONTROL_TABLES
        if stem in tables and not control and not all(of_model(row, model) for row in tables[stem]):
            # stage 1 ran on another model since: these rows are the last model's until their stage reruns
            lines += [
                f"**Not of stage 1's model ({model_named(model)}): rows of an earlier model; rerun this stage.**",
                "",
            ]
        if stem in tables:
            lines.append(markdown_table(_without_repeated_facts(tables[stem], header_facts)))
        if (results_dir / f"{stem}.png").exists():
            lines += ["", f"![{stem}]({stem}.png)"]
    return write_atomically(results_dir / "summary.md", "\n".join(lines) + "\n")


GOALS_STEM = Path(GOALS_CSV).stem
VERSIONED = ("python", *LIBRARIES)  # machine_columns' versions, as "<name>_version"
MACHINE_KEYS = ("cpu", "cores", "isa", *(f"{name}_version" for name in VERSIONED))


def recorded_alike(tables) -> dict[str, str]:
    """Each of MACHINE_KEYS that the rows of `tables` (lists of CSV rows) record, with the one value all of
    those rows give it."""
    facts = {}
    for key in MACHINE_KEYS:
        values = {str(row[key]) for rows in tables for row in rows if row.get(key) not in (None, "")}
        if len(values) == 1:
            facts[key] = values.pop()
    return facts


def _machine_line(facts: dict[str, str], tables) -> str:
    if "cpu" not in facts:
        recorded = any(row.get("cpu") for rows in tables for row in rows)
        return "several: see each table's cpu column" if recorded else "not recorded in these tables"
    return f"{facts['cpu']}, {facts.get('cores', '?')} cores, ISA: {facts.get('isa', '?')}"


def _without_repeated_facts(rows: list[dict], facts: dict) -> list[dict]:
    same = {key for key, value in facts.items() if rows and all(row.get(key) == value for row in rows)}
    return [{key: value for key, value in row.items() if key not in same} for row in rows]
