"""summary.md is rebuilt from whatever CSVs and PNGs are in results/, so later stages need no changes."""

from dataclasses import replace

import pytest

from mnv3.plots import plot_variants
from mnv3.report import cpu_info, markdown_table, write_csv, write_summary

pytestmark = pytest.mark.unit


def test_summary_includes_every_csv_and_png_in_file_name_order(tmp_path):
    write_csv(tmp_path / "02_static.csv", [{"variant": "onnx_static_int8", "mean_ms": 11.1, "weights": "file:abc"}])
    write_csv(tmp_path / "01_baseline.csv", [{"variant": "onnx_fp32", "mean_ms": 8.5, "weights": "file:abc"}])
    write_csv(tmp_path / "05_loadtest.csv", [{"mode": "batched", "rps": 410.1}])  # a later stage's file
    write_csv(tmp_path / "model_variants.csv", [{"variant": "ONNX FP32", "note": "a|b"}])
    plot_variants(
        [{"variant": "ONNX FP32", "mean_ms": 8.5, "p95_ms": 10.7, "size_mb": 21.2}], tmp_path / "model_variants.png"
    )
    (tmp_path / "04_cache.png").write_bytes((tmp_path / "model_variants.png").read_bytes())  # a plot with no CSV
    summary = write_summary(tmp_path).read_text()
    headings = [line for line in summary.splitlines() if line.startswith("## ")]
    assert headings == ["## 01_baseline", "## 02_static", "## 04_cache", "## 05_loadtest", "## model_variants"]
    assert "| mode | rps |\n|---|---|\n| batched | 410.1 |" in summary
    assert "![04_cache](04_cache.png)" in summary and "![model_variants](model_variants.png)" in summary
    assert summary.index("| ONNX FP32 | a\\|b |") < summary.index("![model_variants]")
    assert "file:abc" in summary and "WARNING" not in summary
    assert "- Machine: not recorded in these tables\n" in summary  # not the machine that wrote the summary


def test_summary_warns_about_random_init_weights(tmp_path):
    write_csv(tmp_path / "01_baseline.csv", [{"variant": "onnx_fp32", "weights": "random-init"}])
    assert "WARNING: random-init weights" in write_summary(tmp_path).read_text()


def test_markdown_table_uses_first_row_columns():
    assert markdown_table([{"a": 1, "b": 2}, {"a": 3}]) == "| a | b |\n|---|---|\n| 1 | 2 |\n| 3 |  |"


def test_plot_is_a_png(tmp_path):
    rows = [
        {"variant": name, "mean_ms": ms, "p95_ms": ms * 1.3, "size_mb": mb}
        for name, ms, mb in (("ONNX FP32", 8.5, 21.2), ("ONNX Static INT8", 11.1, 5.6))
    ]
    assert plot_variants(rows, tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


def test_summary_states_the_machine_its_rows_record_and_drops_only_columns_that_repeat_it(tmp_path):
    """Its header named the machine writing it: a stage's quick run here put "AMD EPYC" above a Xeon's tables."""
    xeon = {"cpu": "Intel Xeon", "cores": 2, "isa": "avx2 amx_int8", "onnxruntime_version": "1.32.0"}
    write_csv(tmp_path / "01_baseline.csv", [{"mean_ms": 4.0}])  # from before rows recorded the machine
    write_csv(tmp_path / "03_here.csv", [{"req_per_s": 5, **xeon}])
    write_csv(tmp_path / "05_here_too.csv", [{"req_per_s": 7, **xeon}])
    text = write_summary(tmp_path).read_text()
    assert "- Machine: Intel Xeon, 2 cores, ISA: avx2 amx_int8\n- Libraries: onnxruntime 1.32.0\n" in text
    assert "- Not recorded where they were measured (written before rows said so): 01_baseline\n" in text
    assert "| req_per_s |\n" in text.split("## 03_here")[1]
    other = {"cpu": cpu_info()["cpu"] + " (another)", "onnxruntime_version": "1.31.0"}
    write_csv(tmp_path / "04_elsewhere.csv", [{"req_per_s": 6, **xeon, **other}])
    text = write_summary(tmp_path).read_text()
    assert "- Machine: several: see each table's cpu column\n" in text
    assert "- Libraries: onnxruntime: not the same in every table (see their version columns)\n" in text
    here, elsewhere = text.split("## 03_here")[1].split("## 04_elsewhere")
    assert "| req_per_s | cpu |" in here and "| req_per_s | cpu |" in elsewhere and "cores" not in text.split("## ")[2]


def test_tables_of_an_earlier_model_than_stage_1s_are_marked_and_left_out_of_the_goals(tmp_path):
    """Stage 1 on another model leaves stages 2-5's tables of the last one until they rerun: the summary says
    so above each, and no goal reads them (their goals say to rerun the stage)."""
    from mnv3.goals import measured_goals

    model = {"weights": "file:new", "arch": "mobilenet_v3_small", "classes": 10}
    write_csv(tmp_path / "01_baseline.csv", [{"variant": "onnx_fp32", "mean_ms": 2.0, **model}])
    earlier = {"variant": "onnx_static_int8", "mean_ms_vs_onnx_fp32": 0.5, "weights": "file:old", "classes": 1000}
    write_csv(tmp_path / "02_static.csv", [earlier])
    write_csv(tmp_path / "03_serving_baseline.csv", [{"phase": "unbatched", "weights": "file:new"}])  # no arch: same
    write_csv(tmp_path / "01_transformer_control.csv", [{"variant": "onnx_fp32", "arch": "vision_transformer"}])
    summary = write_summary(tmp_path).read_text()
    marked = "**Not of stage 1's model (weights file:new, arch mobilenet_v3_small, classes 10)"
    assert summary.count(marked) == 1 and summary.index(marked) > summary.index("## 02_static")
    goals = {row["goal"]: row for row in measured_goals(tmp_path)}
    assert (
        goals["static INT8 batch-1 latency / ONNX FP32"]["met"] == "not measured: run `python static_quantization.py`"
    )
    write_csv(tmp_path / "02_static.csv", [earlier | model])  # rerun on the new model
    assert "Not of stage 1's model" not in write_summary(tmp_path).read_text()
    assert {row["goal"]: row for row in measured_goals(tmp_path)}["static INT8 batch-1 latency / ONNX FP32"][
        "measured"
    ] == 0.5


def test_the_same_weights_with_another_preprocessing_are_another_model():
    """model_id names the export and the preprocessing it takes: a table of the same weights, arch and classes
    but another model_id is not stage 1's model's."""
    from mnv3.artifacts import model_id
    from mnv3.preprocess import DEFAULT_PREPROCESSING
    from mnv3.report import of_model, row_model

    export = "ab" * 32
    other = replace(DEFAULT_PREPROCESSING, resize=DEFAULT_PREPROCESSING.resize + 32)
    assert model_id(export, DEFAULT_PREPROCESSING) == model_id(export, DEFAULT_PREPROCESSING)
    assert len({model_id(export, DEFAULT_PREPROCESSING), model_id(export, other), model_id("cd" * 32, other)}) == 3
    same = {"weights": "file:a", "arch": "mobilenet_v3_large", "classes": "1000"}  # as a CSV holds them
    model = row_model(same | {"model_id": model_id(export, DEFAULT_PREPROCESSING)})
    assert not of_model(same | {"model_id": model_id(export, other)}, model)
    assert of_model(same, model)  # a row from before model_id: as far as it says


def test_the_same_tensors_saved_in_two_files_are_one_model():
    """--weights file:<sha256> names the file: the same weights saved twice export to one model_id, which stage 2
    refused as "another model" while printing the one model_id of both."""
    from mnv3.report import of_model, same_model

    saved_twice = [
        {"weights": f"file:{digest}", "arch": "mobilenet_v3_small", "model_id": "cdc0e31a287b"}
        for digest in ("29e5", "acfc")
    ]
    assert same_model(*saved_twice) and of_model(*saved_twice)
    other = saved_twice[1] | {"model_id": "0123456789ab"}
    assert not same_model(saved_twice[0], other) and not of_model(saved_twice[0], other)
    before_model_id = {key: value for key, value in saved_twice[0].items() if key != "model_id"}
    assert not same_model(before_model_id, saved_twice[0])  # stage 2 asks for stage 1's rows of this model
    assert not same_model(before_model_id, before_model_id | {"weights": "file:acfc"})
