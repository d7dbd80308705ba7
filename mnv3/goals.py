"""`python -m mnv3.goals`: the performance goals next to what the CSVs in results/ measured.

Every speed goal is a ratio of two numbers measured on the same machine in the same `make bench` run, so
it survives a noisy shared machine better than an absolute time; the rest are sizes, agreement and SQNR,
and the cache hit's round trip in ms. Writes results/goals.csv (and so a
section of summary.md) and prints the table; a goal whose inputs are missing says which stage to run.
"""

import argparse
from pathlib import Path

from mnv3 import cli
from mnv3.artifacts import (
    BASELINE_CSV,
    BATCHING_CSV,
    CACHING_CSV,
    ENGINES_CSV,
    GOALS_CSV,
    MODEL_VARIANTS_CSV,
    PART_SIZES_CSV,
    RECIPES_CSV,
    RESULTS_DIR,
    STAGE_SCRIPTS,
    STATIC_CSV,
    V2_VS_PREDICT_CSV,
)
from mnv3.report import markdown_table, of_model, read_csv, stage_1_model, write_csv, write_summary


def _rows(results_dir: Path, name: str) -> list[dict]:
    """The table's rows of the model stage 1 last measured: rows of an earlier one are not this model's
    measurements (their goal says to rerun the stage)."""
    path = results_dir / name
    model = stage_1_model(results_dir)
    return [row for row in read_csv(path) if of_model(row, model)] if path.exists() else []


def _find(rows, **match) -> dict | None:
    return next((row for row in rows if all(row.get(k) == v for k, v in match.items())), None)


def _ratio(a, b, key):
    if a is None or b is None or not a.get(key) or not b.get(key):
        return None
    return float(a[key]) / float(b[key])


def value(row, key):
    return float(row[key]) if row and row.get(key) not in (None, "", "nan") else None


def _fastest(results_dir: Path, key: str) -> tuple[str, float | None]:
    """(variant, its `key` / ONNX FP32's), over every variant timed in the same run as ONNX FP32, each by its
    same-run ratio column: stage 1's variants, stage 2's recipes, engine variants and, per image, the chosen
    one's part sizes. Not at batch 1: a single image never runs in parts, so the part-size table's batch-1
    times are the chosen variant's batch-1 call timed four more times, and the lowest of those would be the
    luckiest draw, not a faster variant."""
    ratios = {
        row["variant"]: value(row, f"{key}_vs_onnx_fp32")
        for row in _rows(results_dir, BASELINE_CSV)
        if row.get("variant") not in ("pytorch_fp32", "onnx_fp32")
    }
    ratios |= {
        f"static INT8 {row['recipe']}": value(row, f"{key}_vs_onnx_fp32") for row in _rows(results_dir, RECIPES_CSV)
    }
    ratios |= {
        row["variant"]: value(row, f"{key}_vs_onnx_fp32")
        for row in _rows(results_dir, ENGINES_CSV)
        if row["variant"] != "onnx_fp32"
    }
    ratios |= {
        f"{row['variant']} in parts of {row['part_size']}": value(row, f"{key}_vs_onnx_fp32")
        for row in _rows(results_dir, PART_SIZES_CSV)
        if row["variant"] != "onnx_fp32" and key == "per_image_ms"
    }
    ratios = {name: ratio for name, ratio in ratios.items() if ratio is not None}
    return min(ratios.items(), key=lambda item: item[1], default=("-", None))


# How far apart a stage-5 ratio may come out in its rounds of turns (the headline's, see batching_benchmark;
# /v2 vs /predict's, see v2_benchmark) and still mean one thing: further, the machine's speed moved too much
# within the run for the ratio over all of them to settle a goal its rounds disagree on.
ROUND_SPREAD_TOLERANCE = 1.15


def rounds_of(rows: list[dict], configuration: str, key: str) -> list[float]:
    """Stage 5's ratio `key` in each round of turns: the rows of `configuration`'s turns that carry it."""
    return [
        ratio
        for row in rows
        if row.get("configuration") == configuration and row.get("turn") not in (None, "", "all")
        if (ratio := value(row, key)) is not None
    ]


def verdict(measured: float | None, comparison: str, target: float, rounds: list[float], stage: int) -> str:
    """Whether `measured` meets the goal ("yes" / "no"), or why it cannot say: not measured, or its rounds of
    turns (if any) are more than ROUND_SPREAD_TOLERANCE apart and do not all give the same answer."""
    if measured is None:
        return f"not measured: run `python {STAGE_SCRIPTS[stage]}`"

    def meets(ratio: float) -> bool:
        return ratio <= target if comparison == "<=" else ratio >= target

    if rounds and len({meets(r) for r in rounds}) > 1 and max(rounds) > ROUND_SPREAD_TOLERANCE * min(rounds):
        return (
            f"unreliable: the rounds of turns gave {' and '.join(f'{r:g}' for r in rounds)}, more than "
            f"{ROUND_SPREAD_TOLERANCE - 1:.0%} apart (the machine's speed moved) and not all meeting the goal; "
            f"rerun `python {STAGE_SCRIPTS[stage]}` on a quieter machine"
        )
    return "yes" if meets(measured) else "no"


def shown(measured: float, target: float) -> float:
    """`measured` to 3 decimals, or as many more as it takes not to read as the target itself: a size ratio of
    0.2705 shown as 0.27 beside "<= 0.27" and "no" would look like a wrong verdict."""
    for digits in range(3, 16):
        if (rounded := round(measured, digits)) != target or measured == target:
            return rounded
    return measured


def measured_goals(results_dir=RESULTS_DIR) -> list[dict]:
    results_dir = Path(results_dir)
    variants = _rows(results_dir, MODEL_VARIANTS_CSV)
    fp32, int8 = _find(variants, variant="ONNX FP32"), _find(variants, variant="ONNX Static INT8")
    # The latest stage 2 timed the shipped model in turns with FP32 (with --compare-recipes: its table's row).
    shipped = _find(_rows(results_dir, STATIC_CSV), variant="onnx_static_int8")
    fastest_b1, fastest_batch = _fastest(results_dir, "mean_ms"), _fastest(results_dir, "per_image_ms")
    serving = _rows(results_dir, BATCHING_CSV)
    headline = _find(serving, configuration="batching", turn="all")
    v2_rows = _rows(results_dir, V2_VS_PREDICT_CSV)
    v2 = _find(v2_rows, configuration="v2_binary", turn="all")
    caching = _rows(results_dir, CACHING_CSV)
    hit = _find(caching, run="sequential", phase="hit")

    goals = [
        # (goal, comparison, target, measured, stage that measures it)
        ("static INT8 batch-1 latency / ONNX FP32", "<=", 0.8, value(shipped, "mean_ms_vs_onnx_fp32"), 2),
        (
            "static INT8 per-image time at batch N / ONNX FP32",
            "<=",
            0.6,
            value(shipped, "per_image_ms_vs_onnx_fp32"),
            2,
        ),
        ("static INT8 size / ONNX FP32", "<=", 0.27, _ratio(int8, fp32, "size_mb"), 2),
        ("static INT8 logits SQNR vs FP32 (dB)", ">=", 25, value(int8, "sqnr_db"), 2),
        ("static INT8 top-1 agreement with FP32", ">=", 0.99, value(int8, "top1_agreement"), 2),
        (f"fastest variant batch 1 ({fastest_b1[0]}) / ONNX FP32", "<=", 0.45, fastest_b1[1], 2),
        (f"fastest variant per image at batch N ({fastest_batch[0]}) / ONNX FP32", "<=", 0.35, fastest_batch[1], 2),
        ("batched server req/s / unbatched, same concurrency", ">=", 1.0, value(headline, "speedup_vs_no_batching"), 5),
        (
            "batched server req/s / in-process limit of the engine it serves",
            ">=",
            0.9,
            value(headline, "server_to_limit_ratio"),
            5,
        ),
        ("/v2 binary req/s / /predict, same server, in turns", ">=", 0.95, value(v2, "v2_to_predict_ratio"), 5),
        ("cache hit round trip p50 (ms)", "<=", 2.0, value(hit, "latency_p50_ms"), 4),
        ("cache miss p50 / hit p50", ">=", 10, value(hit, "hit_speedup_p50"), 4),
    ]
    rounds = {
        "batched server req/s / unbatched, same concurrency": rounds_of(serving, "batching", "speedup_vs_no_batching"),
        "batched server req/s / in-process limit of the engine it serves": rounds_of(
            serving, "batching", "server_to_limit_ratio"
        ),
        "/v2 binary req/s / /predict, same server, in turns": rounds_of(v2_rows, "v2_binary", "v2_to_predict_ratio"),
    }
    return [
        {
            "goal": goal,
            "target": f"{comparison} {target}",
            "measured": "" if measured is None else shown(measured, target),
            "met": verdict(measured, comparison, target, rounds.get(goal, []), stage),
        }
        for goal, comparison, target, measured, stage in goals
    ]


def get_args_parser():
    parser = argparse.ArgumentParser(prog="python -m mnv3.goals", description=cli.summary(__doc__))
    parser.add_argument(
        "--results-dir",
        type=Path,
        default=RESULTS_DIR,
        help="the stages' CSVs; goals.csv and summary.md are written there (default %(default)s)",
    )
    return parser


def write_goals(args) -> list[dict]:
    if not args.results_dir.is_dir():  # a typo would get a goals.csv of nothing measured
        raise cli.UsageError(f"{args.results_dir} is not a folder: pass the --results-dir the stages wrote to")
    rows = measured_goals(args.results_dir)
    write_csv(args.results_dir / GOALS_CSV, rows)
    write_summary(args.results_dir)
    return rows


def main(args):
    print(markdown_table(cli.run_stage(write_goals, args)))


if __name__ == "__main__":
    main(get_args_parser().parse_args())
