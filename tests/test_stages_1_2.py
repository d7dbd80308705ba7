"""Stages 1 and 2 end to end in --quick mode into tmp dirs, and the errors a user can cause."""

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import onnxruntime
import pytest

import baseline_export_quantize
import static_quantization
from conftest import offline_weights
from mnv3.quantize import DEFAULT_RECIPE, RECIPES
from mnv3.report import cpu_info, read_csv, write_csv
from mnv3.silicon import count_macs
from mnv3.variants import PART_SIZES

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]


def run_stage(module, *flags):
    module.main(module.get_args_parser().parse_args([str(flag) for flag in flags]))


@pytest.fixture(scope="module")
def stage_dirs(tmp_path_factory):
    """Run stage 1 (offline: random init) then stage 2 comparing every recipe (`make bench`), both --quick."""
    root = tmp_path_factory.mktemp("stages")
    dirs = {"artifacts": root / "artifacts", "results": root / "results", "calibration": root / "calibration"}
    with offline_weights():
        with pytest.warns(UserWarning, match="RANDOM INIT"):
            run_stage(
                baseline_export_quantize,
                "--quick",
                "--artifacts-dir",
                dirs["artifacts"],
                "--results-dir",
                dirs["results"],
                "--transformer-control",
            )
    run_stage(
        static_quantization,
        "--quick",
        "--artifacts-dir",
        dirs["artifacts"],
        "--results-dir",
        dirs["results"],
        "--calibration-dir",
        dirs["calibration"],
        "--compare-recipes",
        "all",
    )
    return dirs


def test_stage_1_writes_sane_baseline_rows(stage_dirs):
    rows = {row["variant"]: row for row in read_csv(stage_dirs["results"] / "01_baseline.csv")}
    assert set(rows) - {"openvino_fp32", "openvino_bf16"} == {
        "pytorch_fp32",
        "onnx_fp32",
        "onnx_dynamic_int8",
        "onnx_dynamic_int8_u8_weights",
    }
    for row in rows.values():
        assert 0 < float(row["p50_ms"]) <= float(row["p95_ms"]) <= float(row["p99_ms"])
        assert float(row["mean_ms"]) > 0 and float(row["per_image_ms"]) > 0
        assert row["weights"] == "random-init" and int(row["bn_recalibration_images"]) > 0
        assert row["threads"] == "2" and row["batch_size"] == "8"
        # where it was measured, as stages 3-5 record it: a summary of results copied from elsewhere shows it
        assert row["cpu"] == cpu_info()["cpu"] and row["onnxruntime_version"] == onnxruntime.__version__
    assert float(rows["onnx_fp32"]["export_max_abs_diff"]) <= 1e-3
    for variant in ("onnx_dynamic_int8", "onnx_dynamic_int8_u8_weights"):
        assert float(rows[variant]["size_mb"]) < 0.35 * float(rows["onnx_fp32"]["size_mb"])
    for variant in ("pytorch_fp32", "onnx_dynamic_int8", "onnx_dynamic_int8_u8_weights"):
        assert 0 <= float(rows[variant]["top1_agreement"]) <= float(rows[variant]["top5_agreement"]) <= 1
    assert float(rows["pytorch_fp32"]["sqnr_db"]) > 60  # the same FP32 network in two runtimes
    profile = read_csv(stage_dirs["results"] / "01_dynamic_int8_profile.csv")
    assert "ConvInteger" in {row["op_type"] for row in profile}
    assert (stage_dirs["artifacts"] / "dynamic_int8_profile.json").exists()


def test_stage_1_transformer_control_writes_its_rows_and_integer_matmul_profile(stage_dirs):
    rows = {row["variant"]: row for row in read_csv(stage_dirs["results"] / "01_transformer_control.csv")}
    assert set(rows) == {"onnx_fp32", "onnx_dynamic_int8"}
    assert {row["model"] for row in rows.values()} == {"vit_2x64"}  # --quick's ViT, not MobileNetV3
    assert float(rows["onnx_dynamic_int8"]["size_mb"]) < 0.5 * float(rows["onnx_fp32"]["size_mb"])
    assert float(rows["onnx_dynamic_int8"]["sqnr_db"]) > 20
    assert all(row["cpu"] and row["onnxruntime_version"] for row in rows.values())  # where it was measured
    summary = (stage_dirs["results"] / "summary.md").read_text()
    assert "Not recorded where they were measured" not in summary  # every table stage 1-2 write today says
    profiled = {row["op_type"] for row in read_csv(stage_dirs["results"] / "01_transformer_control_profile.csv")}
    assert profiled & {"MatMulInteger", "DynamicQuantizeMatMul"}
    # The baseline table stays MobileNetV3's alone: goals and model_variants compare its rows with its FP32.
    assert "model" not in read_csv(stage_dirs["results"] / "01_baseline.csv")[0]


def test_stage_2_writes_static_row_and_four_variant_table(stage_dirs):
    static = read_csv(stage_dirs["results"] / "02_static.csv")[0]
    assert 0 <= float(static["top1_agreement"]) <= 1 and 0 <= float(static["top5_agreement"]) <= 1
    assert 0 < float(static["sqnr_db"]) < float("inf")
    assert static["recipe"] == DEFAULT_RECIPE and static["quant_format"] == RECIPES[DEFAULT_RECIPE].quant_format
    table = read_csv(stage_dirs["results"] / "model_variants.csv")
    seed = ["PyTorch FP32", "ONNX FP32", "ONNX Dynamic INT8", "ONNX Static INT8"]  # plus OpenVINO when installed
    assert [row["variant"] for row in table if row["variant"] in seed] == seed
    by_name = {row["variant"]: row for row in table}
    assert float(by_name["ONNX FP32"]["mean_vs_onnx_fp32"]) == 1.0
    # each row names its model and machine, so a summary flags rows of an earlier model or another CPU
    assert {row["model_id"] for row in table} == {static["model_id"]} != {""}
    assert {row["cpu"] for row in table} == {cpu_info()["cpu"]}
    assert float(by_name["ONNX Static INT8"]["size_mb"]) < 0.35 * float(by_name["ONNX FP32"]["size_mb"])
    assert all(float(row["mean_ms"]) > 0 and float(row["p95_ms"]) > 0 for row in table)
    assert (stage_dirs["results"] / "model_variants.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_compare_recipes_writes_one_sane_row_per_recipe_and_ships_the_default(stage_dirs):
    rows = {row["recipe"]: row for row in read_csv(stage_dirs["results"] / "02_recipes.csv")}
    assert set(rows) == set(RECIPES) and len(read_csv(stage_dirs["results"] / "02_recipes.csv")) == len(RECIPES)
    assert [name for name, row in rows.items() if row["shipped"] == "True"] == [DEFAULT_RECIPE]
    for name, row in rows.items():
        recipe = RECIPES[name].record()
        assert (row["quant_format"], row["per_channel"], row["reduce_range"], row["graph_rewrite"]) == (
            recipe["quant_format"],
            str(recipe["per_channel"]),
            str(recipe["reduce_range"]),
            recipe["graph_rewrite"],
        )
        assert {
            "activation_type",
            "weight_type",
            "calibrate_method",
            "nodes_to_exclude",
            "op_types_to_quantize",
            "extra_options",
        } <= set(row)
        assert 0 < float(row["p50_ms"]) <= float(row["p95_ms"]) and float(row["per_image_ms"]) > 0
        assert row["batch_size"] == "8" and row["threads"] == "2" and row["calibration_images"] == "16"
        assert 0.05 < float(row["mean_ms_vs_onnx_fp32"]) < 20 and 0.05 < float(row["per_image_ms_vs_onnx_fp32"]) < 20
        assert 0.2 < float(row["size_mb_vs_onnx_fp32"]) < 0.3
        assert 0 <= float(row["top1_agreement"]) <= float(row["top5_agreement"]) <= 1
        assert 0 < float(row["sqnr_db"]) < float("inf")
        assert (stage_dirs["artifacts"] / "recipes" / f"{name}.onnx").exists()
    shipped = (stage_dirs["artifacts"] / "recipes" / f"{DEFAULT_RECIPE}.onnx").read_bytes()
    assert (stage_dirs["artifacts"] / "static_int8.onnx").read_bytes() == shipped
    static = read_csv(stage_dirs["results"] / "02_static.csv")[0]  # the shipped recipe's row, same measurement
    assert static["mean_ms"] == rows[DEFAULT_RECIPE]["mean_ms"] and static["sqnr_db"] == rows[DEFAULT_RECIPE]["sqnr_db"]
    assert static["mean_ms_vs_onnx_fp32"] == rows[DEFAULT_RECIPE]["mean_ms_vs_onnx_fp32"]
    # the same recipe in the same words in both tables, its lists and options too
    fields = RECIPES[DEFAULT_RECIPE].record()
    assert {key: static[key] for key in fields} == {key: rows[DEFAULT_RECIPE][key] for key in fields}


def test_stage_2_without_compare_builds_only_the_chosen_recipe(stage_dirs, tmp_path):
    artifacts = tmp_path / "artifacts"
    artifacts.mkdir()
    for name in ("fp32.onnx", "class_names.json", "manifest.json"):
        (artifacts / name).write_bytes((stage_dirs["artifacts"] / name).read_bytes())
    results = tmp_path / "results"
    results.mkdir()
    (results / "01_baseline.csv").write_bytes((stage_dirs["results"] / "01_baseline.csv").read_bytes())
    run_stage(
        static_quantization,
        "--quick",
        "--artifacts-dir",
        artifacts,
        "--results-dir",
        results,
        "--calibration-dir",
        stage_dirs["calibration"],
        "--recipe",
        "qdq_per_tensor_minmax",
    )
    static = read_csv(results / "02_static.csv")[0]
    assert static["recipe"] == "qdq_per_tensor_minmax" and static["per_channel"] == "False"
    # timed in turns with an FP32 session of its own, not against stage 1's FP32 from another run
    assert 0.05 < float(static["mean_ms_vs_onnx_fp32"]) < 20 and 0.05 < float(static["per_image_ms_vs_onnx_fp32"]) < 20
    variants = {row["variant"]: row for row in read_csv(results / "model_variants.csv")}
    assert variants["ONNX Static INT8"]["mean_vs_onnx_fp32"] == str(round(float(static["mean_ms_vs_onnx_fp32"]), 2))
    assert not (results / "02_recipes.csv").exists() and not (artifacts / "recipes").exists()
    assert (
        json.loads((artifacts / "manifest.json").read_text())["static_int8"]["recipe_name"] == "qdq_per_tensor_minmax"
    )


def test_unknown_compare_recipe_is_rejected_by_argparse(capsys):
    with pytest.raises(SystemExit) as exit_info:
        static_quantization.get_args_parser().parse_args(["--compare-recipes", "qdq_per_channel_minmax,nope"])
    assert exit_info.value.code == 2 and "nope" in capsys.readouterr().err
    assert static_quantization.get_args_parser().parse_args(["--compare-recipes"]).compare_recipes == sorted(RECIPES)


def test_manifest_records_provenance_files_and_recipe(stage_dirs):
    manifest = json.loads((stage_dirs["artifacts"] / "manifest.json").read_text())
    assert manifest["weights"] == "random-init"
    for entry in ("fp32", "dynamic_int8", "static_int8"):
        assert (stage_dirs["artifacts"] / manifest[entry]["path"]).exists()
    recipe = manifest["static_int8"]["recipe"]
    assert (
        recipe["quant_format"],
        recipe["per_channel"],
        recipe["activation_type"],
        recipe["weight_type"],
        recipe["calibrate_method"],
    ) == ("QDQ", True, "QUInt8", "QInt8", "MinMax")
    assert "reduce_range" in recipe and recipe["nodes_to_exclude"] == []
    assert recipe["graph_rewrite"] == RECIPES[DEFAULT_RECIPE].record()["graph_rewrite"]
    assert manifest["static_int8"]["calibration_images"] == 16


def test_stage_2_records_the_fastest_engine_for_auto_and_that_the_stand_in_is_not_guarded(stage_dirs):
    rows = read_csv(stage_dirs["results"] / "02_engines.csv")
    entry = json.loads((stage_dirs["artifacts"] / "manifest.json").read_text())["engine_choice"]
    [chosen] = [row for row in rows if row["chosen"] == "True"]
    assert (entry["variant"], entry["engine"], entry["file"], entry["precision"]) == (
        chosen["variant"],
        chosen["engine"],
        chosen["file"],
        chosen["precision"],
    )
    assert (stage_dirs["artifacts"] / entry["file"]).exists() and entry["for_model"] == "static_int8.onnx"
    # the yardstick (onnxruntime's defaults, as stage 1 times ONNX FP32) is a row, never the choice
    assert rows[0]["variant"] == "onnx_fp32" and float(rows[0]["mean_ms_vs_onnx_fp32"]) == 1.0
    assert rows[0]["chosen"] == "False" and entry["variant"] != "onnx_fp32"
    assert {"onnxruntime_fp32", "onnxruntime_static_int8"} <= {row["variant"] for row in rows}
    assert all(float(row["mean_ms_vs_onnx_fp32"]) > 0 and float(row["per_image_ms_vs_onnx_fp32"]) > 0 for row in rows)
    assert entry["mean_ms_vs_onnx_fp32"] == float(chosen["mean_ms_vs_onnx_fp32"]) and entry["batch_size"] == 8
    assert not entry["guard_applied"] and entry["agreement_guard"].startswith("not applied")
    assert entry["cpu"] and entry["threads"] == 2 and entry["weights"] == "random-init"


def test_stage_2_measures_the_part_size_of_a_chosen_openvino_engine(stage_dirs):
    entry = json.loads((stage_dirs["artifacts"] / "manifest.json").read_text())["engine_choice"]
    path = stage_dirs["results"] / "02_part_sizes.csv"
    if entry["engine"] != "openvino":  # onnxruntime runs a batch whole: nothing to measure
        assert not path.exists() and "part_size" not in entry
        return
    rows = read_csv(path)
    assert rows[0]["variant"] == "onnx_fp32" and float(rows[0]["per_image_ms_vs_onnx_fp32"]) == 1.0
    # every row names the threads and the model it measured, the yardstick too
    models = {(row["threads"], row["weights"], row["arch"]) for row in rows}
    assert models == {("2", "random-init", "mobilenet_v3_large")}
    sized = rows[1:]
    # quick mode's batch of 8: each power of two from 2 up to a stream's share of it
    assert [int(row["part_size"]) for row in sized] == [s for s in PART_SIZES if s <= 8 // entry["streams"]]
    assert {row["variant"] for row in sized} == {entry["variant"]}
    [chosen] = [row for row in sized if row["chosen"] == "True"]
    assert float(chosen["per_image_ms_vs_onnx_fp32"]) == min(float(row["per_image_ms_vs_onnx_fp32"]) for row in sized)
    assert entry["part_size"] == int(chosen["part_size"])
    assert entry["part_size_per_image_ms_vs_onnx_fp32"] == float(chosen["per_image_ms_vs_onnx_fp32"])
    assert f"batches in parts of {entry['part_size']} images" in entry["reason"]


def test_stage_2_measures_the_batch_threads_a_server_gives_a_chosen_openvino_engine(stage_dirs):
    entry = json.loads((stage_dirs["artifacts"] / "manifest.json").read_text())["engine_choice"]
    path = stage_dirs["results"] / "02_batch_threads.csv"
    if entry["engine"] != "openvino":  # onnxruntime runs every call on the intra-op threads
        assert not path.exists() and "batch_threads" not in entry
        return
    rows = read_csv(path)
    # quick mode: one round of turns, mirrored (half the threads, then all; then all, then half), every request
    assert [(row["batch_threads"], row["turn"]) for row in rows] == [("1", "1"), ("2", "1"), ("2", "2"), ("1", "2")]
    assert all(row["ok"] == row["sent"] == "32" and float(row["req_per_s"]) > 0 for row in rows)
    model_id = json.loads((stage_dirs["artifacts"] / "manifest.json").read_text())["model"]["id"]
    assert {row["model_id"] for row in rows} == {model_id}  # summary.md can tell when stage 1 moved on
    rates = entry["batch_threads_req_per_s"]
    assert set(rates) == {"1", "2"} and entry["batch_threads"] == int(max(rates, key=rates.get))
    assert {row["chosen"] for row in rows if int(row["batch_threads"]) == entry["batch_threads"]} == {"True"}
    assert f"a server's batches on {entry['batch_threads']} thread(s)" in entry["reason"]


def test_stage_2_says_how_far_each_engine_is_from_the_measured_peak(stage_dirs):
    rows = read_csv(stage_dirs["results"] / "02_engines.csv")
    macs = count_macs(stage_dirs["artifacts"] / "fp32.onnx")
    for row in rows:
        # Every file but FP32 is quantized; OpenVINO computes FP32 in its precision hint, onnxruntime in f32.
        expected = "int8" if row["file"] != "fp32.onnx" else {"bf16": "bf16"}.get(row["precision"], "f32")
        assert row["computes_in"] == expected
        # per_image_ms is rounded to the microsecond in the CSV
        assert float(row["gmac_per_s"]) == pytest.approx(macs / float(row["per_image_ms"]) / 1e6, rel=0.01)
    if importlib.util.find_spec("openvino") is None:  # the peaks are measured with OpenVINO
        assert all(row["of_peak"] == "" for row in rows)
        assert not (stage_dirs["results"] / "02_openvino_profile.csv").exists()
        return
    for row in rows:  # both from the unrounded rate: gmac_per_s is rounded to 0.1, of_peak to 0.001
        peak = float(row["peak_gmac_per_s"])
        assert float(row["of_peak"]) == pytest.approx(float(row["gmac_per_s"]) / peak, abs=0.05 / peak + 5e-4)
    # The layer profile is of the chosen variant where OpenVINO runs it, else of the fastest OpenVINO one.
    [chosen] = [row for row in rows if row["chosen"] == "True"]
    openvino_rows = [row for row in rows if row["engine"] == "openvino"]
    expected = chosen if chosen["engine"] == "openvino" else min(openvino_rows, key=lambda r: float(r["per_image_ms"]))
    layers = read_csv(stage_dirs["results"] / "02_openvino_profile.csv")
    assert {layer["variant"] for layer in layers} == {expected["variant"]}
    # Both calls the server makes: a single image on both threads, and a batch's part on a stream's share.
    threads = {layer["batch_size"]: layer["threads"] for layer in layers}
    part = max(int(size) for size in threads)
    assert part > 1 and threads == {"1": "2", str(part): str(max(2 // int(expected["streams"]), 1))}
    for size in threads:
        shares = [float(layer["share_pct"]) for layer in layers if layer["batch_size"] == size]
        assert sum(shares) == pytest.approx(100, abs=0.5)


@pytest.mark.parametrize("value", ["1.5", "-0.1"])
def test_min_agreement_outside_0_1_is_rejected_by_argparse(value, capsys):
    with pytest.raises(SystemExit) as exit_info:
        static_quantization.get_args_parser().parse_args(["--min-agreement", value])
    assert exit_info.value.code == 2 and "--min-agreement" in capsys.readouterr().err


def test_summary_has_every_table_in_file_order(stage_dirs):
    summary = (stage_dirs["results"] / "summary.md").read_text()
    sections = ["## 01_baseline", "## 01_dynamic_int8_profile", "## 02_recipes", "## 02_static", "## model_variants"]
    assert [summary.index(s) for s in sections] == sorted(summary.index(s) for s in sections)
    assert "| PyTorch FP32 |" in summary and "| ConvInteger |" in summary and "| onnx_static_int8 |" in summary
    assert "![model_variants](model_variants.png)" in summary
    assert "random-init" in summary and "onnxruntime" in summary


def test_stage_2_without_stage_1_names_stage_1(tmp_path):
    result = subprocess.run(
        [sys.executable, "static_quantization.py", "--quick", "--artifacts-dir", tmp_path, "--results-dir", tmp_path],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "stage 1" in result.stderr and "baseline_export_quantize.py" in result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_bad_weights_file_exits_2_with_one_line(tmp_path, capsys):
    (tmp_path / "bad.pth").write_bytes(b"not a checkpoint")
    with pytest.raises(SystemExit) as exit_info:
        run_stage(
            baseline_export_quantize,
            "--quick",
            "--weights",
            tmp_path / "bad.pth",
            "--artifacts-dir",
            tmp_path,
            "--results-dir",
            tmp_path,
        )
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.startswith("error: --weights")
    assert not (tmp_path / "fp32.onnx").exists()


def test_unreadable_labels_exit_2(stage_dirs, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:  # checked before any calibration or output
        run_stage(
            static_quantization,
            "--quick",
            "--labels",
            tmp_path / "nope.csv",
            "--artifacts-dir",
            stage_dirs["artifacts"],
            "--results-dir",
            stage_dirs["results"],
            "--calibration-dir",
            tmp_path,
        )
    assert exit_info.value.code == 2
    assert "--labels" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--batch-size", "--threads"])
def test_non_positive_counts_are_rejected_by_argparse(flag, capsys):
    with pytest.raises(SystemExit) as exit_info:
        baseline_export_quantize.get_args_parser().parse_args([flag, "0"])
    assert exit_info.value.code == 2 and flag in capsys.readouterr().err


def test_stage_2_says_when_it_calibrates_on_generated_photos(tmp_path):
    from mnv3.photos import held_out_images
    from mnv3.quantize import calibration_photos

    typo = tmp_path / "my_calibraton_photos"  # not the folder of photos the user meant
    note = static_quantization.generated_calibration_note(typo, calibration_photos(typo, 3), existed=False)
    assert note.startswith(f"calibration: no photos of yours in {typo} (created now), so 3 generated views")
    note = static_quantization.generated_calibration_note(typo, calibration_photos(typo, 3), existed=True)
    assert note.startswith(f"calibration: no photos of yours in {typo}, so 3 generated views")
    user = tmp_path / "user"
    user.mkdir()
    held_out_images(1)[0].save(user / "mine.jpg")
    assert static_quantization.generated_calibration_note(user, calibration_photos(user, 3), existed=True) is None


def test_labelled_photos_that_are_calibration_photos_are_counted_however_reached(tmp_path):
    (tmp_path / "val").mkdir()
    photos = [tmp_path / "val" / f"{i}.jpg" for i in range(3)]
    for photo in photos:
        photo.write_bytes(b"")
    (tmp_path / "calibration").symlink_to(tmp_path / "val")
    calibration = [tmp_path / "calibration" / "0.jpg", tmp_path / "calibration" / "2.jpg"]
    assert static_quantization.calibrated_on(photos, calibration) == 2
    assert static_quantization.calibrated_on(photos[1:2], calibration) == 0


def test_corrupt_calibration_image_exits_2_naming_the_file(stage_dirs, tmp_path, capsys):
    calibration = tmp_path / "calibration"
    calibration.mkdir()
    (calibration / "holiday.jpg").write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg")
    manifest = (stage_dirs["artifacts"] / "manifest.json").read_text()
    with pytest.raises(SystemExit) as exit_info:
        run_stage(
            static_quantization,
            "--quick",
            "--artifacts-dir",
            stage_dirs["artifacts"],
            "--results-dir",
            stage_dirs["results"],
            "--calibration-dir",
            calibration,
        )
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert "holiday.jpg" in error and "remove or replace" in error and "Traceback" not in error
    # refused before anything was replaced: the last run's engine choice still serves --backend auto
    assert (stage_dirs["artifacts"] / "manifest.json").read_text() == manifest


def test_a_cut_short_fp32_model_exits_2_before_anything_is_replaced(stage_dirs, tmp_path, capsys):
    artifacts = tmp_path / "artifacts"
    shutil.copytree(stage_dirs["artifacts"], artifacts)
    fp32 = artifacts / "fp32.onnx"
    fp32.write_bytes(fp32.read_bytes()[: fp32.stat().st_size // 4])  # a copy cut short, a disk that filled up
    manifest = (artifacts / "manifest.json").read_text()
    with pytest.raises(SystemExit) as exit_info:
        run_stage(static_quantization, "--quick", "--artifacts-dir", artifacts, "--results-dir", stage_dirs["results"])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert f"{fp32} is not a readable ONNX model" in error and "rerun stage 1" in error and "Traceback" not in error
    assert (artifacts / "manifest.json").read_text() == manifest


def test_stage_2_refuses_stage_1_rows_of_another_model(stage_dirs, tmp_path, capsys):
    """--results-dir of one stage 1 run beside --artifacts-dir of another: its table would pair two models."""
    results = tmp_path / "results"
    shutil.copytree(stage_dirs["results"], results)
    rows = read_csv(results / "01_baseline.csv")
    other = {"arch": "mobilenet_v3_small", "classes": "3", "model_id": "0123456789ab"}
    write_csv(results / "01_baseline.csv", [row | other for row in rows])
    with pytest.raises(SystemExit) as exit:
        run_stage(static_quantization, "--quick", "--artifacts-dir", stage_dirs["artifacts"], "--results-dir", results)
    assert exit.value.code == 2
    error = capsys.readouterr().err.strip()
    assert "of another model (weights random-init, arch mobilenet_v3_small, classes 3, model_id 0123456789ab)" in error
    assert "(weights random-init, arch mobilenet_v3_large, classes 1000, model_id " in error
    assert "Traceback" not in error


def test_stage_2_without_stage_1_table_names_the_model_a_rerun_must_remake(stage_dirs, tmp_path, capsys):
    """The artifacts of a stage 1 run, another --results-dir: rerunning stage 1 on its defaults (what the
    generic hint said) would export the default model over a user's fine-tune."""
    with pytest.raises(SystemExit) as exit:
        run_stage(static_quantization, "--quick", "--artifacts-dir", stage_dirs["artifacts"], "--results-dir", tmp_path)
    assert exit.value.code == 2
    error = capsys.readouterr().err.strip()
    assert f"{tmp_path / '01_baseline.csv'} not found: stage 1 writes it beside the model now in " in error
    assert "(weights random-init, arch mobilenet_v3_large, classes 1000, model_id " in error
    assert "the flags that made that model (--arch, --weights, --class-names" in error
    assert len(error.splitlines()) == 1 and not (tmp_path / "02_static.csv").exists()


def test_stage_2_without_stage_1_manifest_names_it_not_another_model(stage_dirs, tmp_path, capsys):
    """fp32.onnx and stage 1's table but no manifest (copied by hand): the model read as "weights unknown, arch
    unknown" and the refusal blamed the table for being of another model."""
    artifacts = tmp_path / "artifacts"
    shutil.copytree(stage_dirs["artifacts"], artifacts)
    (artifacts / "manifest.json").unlink()
    with pytest.raises(SystemExit) as exit:
        run_stage(static_quantization, "--quick", "--artifacts-dir", artifacts, "--results-dir", stage_dirs["results"])
    assert exit.value.code == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith(f"error: {artifacts / 'manifest.json'} not found: it is written by stage 1. Run `python ")
    assert "another model" not in error and len(error.splitlines()) == 1


def test_stage_2_refuses_an_empty_stage_1_table(stage_dirs, tmp_path, capsys):
    results = tmp_path / "results"
    shutil.copytree(stage_dirs["results"], results)
    (results / "01_baseline.csv").write_text("")  # a stage 1 killed while writing, or a file emptied by hand
    with pytest.raises(SystemExit) as exit:
        run_stage(static_quantization, "--quick", "--artifacts-dir", stage_dirs["artifacts"], "--results-dir", results)
    assert exit.value.code == 2
    error = capsys.readouterr().err.strip()
    assert "01_baseline.csv holds no rows: rerun stage 1" in error and "Traceback" not in error


def test_a_stage_2_stopped_midway_leaves_no_choice_of_the_last_run(stage_dirs, tmp_path, monkeypatch):
    """Its files are being rebuilt: --backend auto would serve the last run's choice, measured on files since
    replaced (seen after a Ctrl-C in the first seconds of stage 2)."""
    artifacts = tmp_path / "artifacts"
    shutil.copytree(stage_dirs["artifacts"], artifacts)
    manifest = json.loads((artifacts / "manifest.json").read_text())
    # the last run's choice (the fixture's may be gone: a test before this one stopped its stage 2 too)
    manifest["engine_choice"] = {"engine": "openvino", "file": "nncf_int8.xml", "variant": "openvino_nncf_int8_f32"}
    (artifacts / "manifest.json").write_text(json.dumps(manifest))

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(static_quantization, "quantize_static_int8", interrupted)
    results = tmp_path / "results"
    shutil.copytree(stage_dirs["results"], results)
    with pytest.raises(SystemExit) as exit_info:
        run_stage(
            static_quantization, "--quick", "--artifacts-dir", artifacts, "--results-dir", results,
            "--calibration-dir", stage_dirs["calibration"],
        )  # fmt: skip
    assert exit_info.value.code == 130  # Ctrl-C: one line, no traceback
    assert "engine_choice" not in json.loads((artifacts / "manifest.json").read_text())


def test_stage_1_removes_the_last_models_stage_2_builds_even_after_a_run_stopped_midway(stage_dirs, tmp_path, capsys):
    import torch
    from torchvision.models import mobilenet_v3_large

    built, artifacts = stage_dirs["artifacts"], tmp_path / "artifacts"
    shutil.copytree(built, artifacts)
    torch.manual_seed(1)
    torch.save(mobilenet_v3_large().state_dict(), tmp_path / "other.pth")
    flags = ("--quick", "--backends", "onnxruntime", "--weights", tmp_path / "other.pth", "--artifacts-dir", artifacts)
    run_stage(baseline_export_quantize, *flags, "--results-dir", tmp_path / "results")
    assert "rerun stage 2" in capsys.readouterr().out and not (artifacts / "static_int8.onnx").exists()

    # A run stopped (killed) after its export and before it removed them: the other model's fp32.onnx beside
    # the last model's stage-2 builds and manifest. Its rerun compared the export with that file and kept them.
    stage_2_builds = [path for path in built.iterdir() if path.is_file() and not (artifacts / path.name).exists()]
    assert any(path.suffix == ".xml" for path in stage_2_builds) == bool(importlib.util.find_spec("openvino"))
    for path in [*stage_2_builds, built / "manifest.json"]:
        shutil.copy2(path, artifacts / path.name)
    run_stage(baseline_export_quantize, *flags, "--results-dir", tmp_path / "results")
    assert "rerun stage 2" in capsys.readouterr().out
    assert not any((artifacts / path.name).exists() for path in stage_2_builds)
    assert "engine_choice" not in json.loads((artifacts / "manifest.json").read_text())


def test_stage_2_refuses_class_names_cut_short_with_one_line(stage_dirs, tmp_path, capsys):
    artifacts = tmp_path / "artifacts"
    shutil.copytree(stage_dirs["artifacts"], artifacts)
    (artifacts / "class_names.json").write_text('["tench", "gold')  # was json's traceback
    with pytest.raises(SystemExit) as exit_info:
        run_stage(static_quantization, "--quick", "--artifacts-dir", artifacts, "--results-dir", tmp_path / "results")
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert error.startswith(f"error: {artifacts / 'class_names.json'} is not a JSON list of class names (")
    assert "stage 1 writes it: run python baseline_export_quantize.py" in error and error.count("\n") == 1
