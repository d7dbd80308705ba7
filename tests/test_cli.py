"""The plumbing every entry point shares: --quick defaults that never override a flag, and one-line errors."""

import errno
import json
import os
import signal
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest

import batching_loadtest
import caching
import fastapi_serving
from conftest import WAIT_S
from mnv3 import cli
from mnv3.artifacts import MissingArtifact, replaced_when_written, write_atomically
from mnv3.backend_choice import DEFAULT_MIN_AGREEMENT

pytestmark = pytest.mark.unit


def parse(stage, *flags):
    return stage.get_args_parser().parse_args(list(flags))


def test_quick_and_full_fill_only_what_the_user_left_unset():
    full = cli.fill_load_defaults(parse(caching), sequential_requests=cli.FULL.sequential_requests)
    assert (full.concurrency, full.requests, full.sequential_requests) == (250, 1000, 50)
    quick = cli.fill_load_defaults(parse(caching, "--quick"), sequential_requests=cli.QUICK.sequential_requests)
    assert (quick.concurrency, quick.requests, quick.sequential_requests) == (8, 32, 8)
    chosen = cli.fill_load_defaults(parse(caching, "--quick", "--concurrency", "5", "--requests", "7"))
    assert (chosen.concurrency, chosen.requests) == (5, 7)
    assert cli.defaults(parse(caching, "--quick")) is cli.QUICK and cli.defaults(parse(caching)) is cli.FULL


def test_with_real_weights_agreement_is_measured_on_enough_photos_for_the_guard_to_allow_a_disagreement():
    for weights in ("imagenet1k_v1", "file:0123456789ab"):
        photos = cli.FULL.held_out_count(weights)
        assert (1 - 1 / photos) >= DEFAULT_MIN_AGREEMENT  # one photo of them flipped still passes the default guard
    assert cli.FULL.held_out_count("random-init") == cli.FULL.held_out_images  # no guard: the usual count
    assert cli.QUICK.held_out_count("file:0123456789ab") == cli.QUICK.held_out_images


def test_load_tests_take_the_servers_defaults():
    from mnv3.config import ServerConfig

    args = parse(batching_loadtest)
    assert (args.batch_window_ms, args.max_batch_size) == (ServerConfig.batch_window_ms, ServerConfig.max_batch_size)
    assert (args.intra_op_threads, args.inter_op_threads) == (
        ServerConfig.intra_op_threads,
        ServerConfig.inter_op_threads,
    )
    # Unset, the server decides (ServerProcess passes no flag for None)
    assert cli.server_options(args)["batch_threads"] is None
    assert cli.server_options(parse(batching_loadtest, "--batch-threads", "2"))["batch_threads"] == 2


@pytest.mark.parametrize("error", [MissingArtifact("x.onnx not found: run stage 1"), cli.UsageError("lower --x")])
def test_an_error_the_user_can_fix_is_one_line_and_exit_2(error, capsys):
    def run(args):
        raise error

    with pytest.raises(SystemExit) as exit_info:
        cli.run_stage(run, None)
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == f"error: {error}\n"


def test_a_folder_the_stage_cannot_write_is_one_line_before_any_work(tmp_path, capsys):
    ran = []
    (tmp_path / "a_file").write_text("")
    for folder, said in ((tmp_path / "a_file", "is a file"), (tmp_path / "a_file" / "below", "cannot write there")):
        with pytest.raises(SystemExit) as exit_info:
            cli.run_stage(ran.append, SimpleNamespace(results_dir=folder), writes=("results_dir",))
        error = capsys.readouterr().err
        assert exit_info.value.code == 2 and error.startswith(f"error: --results-dir {folder}") and said in error
    assert ran == []  # refused before the stage did its work (a load test ran to its end, then a traceback)
    made = tmp_path / "new" / "results"
    cli.run_stage(ran.append, SimpleNamespace(results_dir=made), writes=("results_dir",))
    assert made.is_dir() and list(made.iterdir()) == [] and len(ran) == 1  # made, and the check leaves nothing


def test_sigterm_stops_a_stage_as_ctrl_c_does_cleaning_up_first(capsys):
    # Python's default ends the process at once: a stage's `with ServerProcess(...)` left its server running
    cleaned_up = []

    def stage(args):
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(WAIT_S)  # the signal's handler raises here
        finally:
            cleaned_up.append(True)

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as exit_info:
        cli.run_stage(stage, None)
    assert exit_info.value.code == 143 and cleaned_up == [True]
    assert capsys.readouterr().err == "terminated\n"
    assert signal.getsignal(signal.SIGTERM) is before  # the stage's handler is gone with it


@pytest.mark.parametrize("stop", [cli.UsageError("no such --weights"), KeyboardInterrupt()])
def test_a_refused_run_removes_the_folders_it_made_unless_it_wrote_there(tmp_path, stop, capsys):
    def refused(args):
        if args.write:
            (args.artifacts_dir / "fp32.onnx").write_text("")
        raise stop

    (tmp_path / "mine").mkdir()
    for write in (False, True):
        args = SimpleNamespace(artifacts_dir=tmp_path / "typo" / "a", results_dir=tmp_path / "mine", write=write)
        with pytest.raises(SystemExit):
            cli.run_stage(refused, args, writes=("artifacts_dir", "results_dir"))
        # a mistyped path leaves nothing behind; what the run wrote, and a folder that was there, stay
        assert (tmp_path / "typo").exists() == write and (tmp_path / "mine").is_dir()
    # two new folders under one new parent: the parent goes too, whichever was made first
    args = SimpleNamespace(artifacts_dir=tmp_path / "new" / "a", results_dir=tmp_path / "new" / "r", write=False)
    with pytest.raises(SystemExit):
        cli.run_stage(refused, args, writes=("artifacts_dir", "results_dir"))
    assert not (tmp_path / "new").exists()
    assert (tmp_path / "typo" / "a" / "fp32.onnx").is_file()
    capsys.readouterr()


def test_a_second_stage_writing_models_to_the_same_folder_is_refused_until_the_first_ends(tmp_path, capsys):
    # Two runs on one --artifacts-dir interleaved their models and manifest (a stage-2 build of the old model
    # left beside the new one, a manifest made unreadable).
    args = SimpleNamespace(artifacts_dir=tmp_path, results_dir=tmp_path)
    ran = []
    first = cli.hold_folder(tmp_path, "--artifacts-dir")  # a first run, under way
    with pytest.raises(SystemExit) as refused:
        cli.run_stage(ran.append, args, writes=("artifacts_dir", "results_dir"))
    assert refused.value.code == 2 and not ran
    error = capsys.readouterr().err
    assert error == (
        f"error: another stage is writing models to --artifacts-dir {tmp_path}; wait for it to finish, or give "
        "this run a --artifacts-dir of its own\n"
    )
    cli.run_stage(ran.append, SimpleNamespace(results_dir=tmp_path), writes=("results_dir",))  # a load test: not held
    os.close(first)
    killed_midway = tmp_path / ".fp32.onnx.k1ll3d.partial"  # a write whose process was killed (SIGKILL)
    killed_midway.mkdir()
    (killed_midway / "fp32.onnx").write_bytes(b"\x08" * 1000)
    cli.run_stage(ran.append, args, writes=("artifacts_dir", "results_dir"))
    assert not killed_midway.exists()  # the run that holds the folder removes what nothing else could
    cli.run_stage(ran.append, args, writes=("artifacts_dir", "results_dir"))  # the last run let go of it
    assert len(ran) == 3 and sorted(tmp_path.iterdir()) == []


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS])
def test_a_disk_that_fills_up_midway_is_one_line_and_exit_2(code, tmp_path, capsys):
    def fills_up(args):
        raise OSError(code, os.strerror(code), str(tmp_path / "fp32.onnx"))

    with pytest.raises(SystemExit) as stopped:
        cli.run_stage(fills_up, SimpleNamespace(results_dir=tmp_path), writes=("results_dir",))
    assert stopped.value.code == 2
    assert (
        capsys.readouterr().err
        == f"error: {os.strerror(code)}: {tmp_path / 'fp32.onnx'}: free space, or pass another folder\n"
    )


def test_a_file_is_replaced_only_once_written_in_full_and_a_reader_keeps_the_old_one(tmp_path):
    ir, weights = tmp_path / "model.xml", tmp_path / "model.bin"
    ir.write_text("old graph")
    weights.write_text("old weights")
    with weights.open() as served:  # as a server's OpenVINO maps the weights of the IR it serves
        with pytest.raises(OSError), replaced_when_written(ir) as partial:
            partial.with_suffix(".bin").write_text("new weights")
            raise OSError(errno.ENOSPC, "No space left on device")
        assert (ir.read_text(), weights.read_text()) == ("old graph", "old weights")
        assert sorted(path.name for path in tmp_path.iterdir()) == ["model.bin", "model.xml"]  # no remains
        with replaced_when_written(ir) as partial:
            partial.write_text("new graph")
            partial.with_suffix(".bin").write_text("new weights")
        assert (ir.read_text(), weights.read_text()) == ("new graph", "new weights")
        assert served.read() == "old weights"  # written in place, the weights changed under the server
    assert sorted(path.name for path in tmp_path.iterdir()) == ["model.bin", "model.xml"]


def test_ctrl_c_while_an_ir_is_renamed_waits_until_both_of_its_files_are(tmp_path, monkeypatch):
    ir = tmp_path / "model.xml"
    rename, renamed = Path.replace, []

    def interrupted(self, target):
        renamed.append(rename(self, target))
        if len(renamed) == 1:
            os.kill(os.getpid(), signal.SIGINT)  # once the weights are renamed, before the graph is
        return renamed[-1]

    monkeypatch.setattr(Path, "replace", interrupted)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # Python's, whatever earlier tests left
    try:
        with pytest.raises(KeyboardInterrupt), replaced_when_written(ir) as partial:
            partial.write_text("new graph")
            partial.with_suffix(".bin").write_text("new weights")
    finally:
        signal.signal(signal.SIGINT, previous)
    assert (ir.read_text(), (tmp_path / "model.bin").read_text()) == ("new graph", "new weights")  # not half


def test_a_folder_that_cannot_be_opened_to_hold_it_is_one_line(tmp_path, monkeypatch):
    def refused(*args, **kwargs):  # a folder one may write to but not read (mode 0333; root reads anything)
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(os, "open", refused)
    with pytest.raises(cli.UsageError, match=r"cannot open it to hold it \(Permission denied\); make it readable"):
        cli.hold_folder(tmp_path, "--artifacts-dir")


def test_two_writers_of_one_file_at_once_leave_it_whole(tmp_path):
    # With one temporary name for both, one writer renamed the other's file away (FileNotFoundError) or
    # wrote into it as it was renamed, leaving a manifest that was not JSON.
    path = tmp_path / "manifest.json"

    def write(writer: int) -> None:
        for count in range(300):
            write_atomically(path, json.dumps({"writer": writer, "count": count, "padding": "x" * 4000}))

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(write, range(4)))
    assert json.loads(path.read_text())["count"] == 299
    assert [file.name for file in tmp_path.iterdir()] == ["manifest.json"]


def test_a_stages_own_warning_is_one_line_and_others_keep_pythons_format():
    """What Python prints a warning with (pytest records them instead, so this asks the formatter)."""

    def run(args):
        return [
            warnings.formatwarning(message, category, "stage.py", 151, "  model = load_model()")
            for message, category in (("no --class-names", UserWarning), ("old API", DeprecationWarning))
        ]

    own, library = cli.run_stage(run, None)
    assert own == "warning: no --class-names\n"
    assert library.startswith("stage.py:151: DeprecationWarning: old API\n")
    assert warnings.formatwarning is not cli._format_warning  # Python's again once the stage is done


def test_run_stage_returns_what_the_stage_returns_and_lets_bugs_through():
    assert cli.run_stage(lambda args: args * 2, 21) == 42
    with pytest.raises(ZeroDivisionError):
        cli.run_stage(lambda args: 1 / 0, None)


@pytest.mark.parametrize(
    "flags, message",
    [
        (("--open-loop-fraction", "0"), "argument --open-loop-fraction: '0' is not a number above 0"),
        (("--open-loop-seconds=-2",), "argument --open-loop-seconds: '-2' is not a number above 0"),
        (("--start-timeout", "nan"), "argument --start-timeout: 'nan' is not a number above 0"),
        (("--batch-window-ms", "inf"), "argument --batch-window-ms: 'inf' is not a number of at least 0"),
        (("--concurrency", "0"), "argument --concurrency: '0' is not a whole number of at least 1"),
        (("--max-batch-size", "2.5"), "'2.5' is not a whole number from 1 to 256 (the server's bound)"),
        # accepted here, it failed only once the stage's server refused it at start-up
        (("--max-batch-size", "257"), "'257' is not a whole number from 1 to 256 (the server's bound)"),
    ],
)
def test_a_flag_value_that_cannot_work_is_refused_before_any_work(flags, message, capsys):
    # --open-loop-fraction 0 ran the whole sweep, then ended in a traceback ("open-loop rate must be positive")
    with pytest.raises(SystemExit) as exit:
        parse(batching_loadtest, *flags)
    assert exit.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith(message)


def test_bounded_types_keep_what_is_in_bounds():
    assert (cli.positive_int("3"), cli.non_negative_int("0"), cli.positive_float("0.5")) == (3, 0, 0.5)
    assert parse(batching_loadtest, "--max-batch-size", "256").max_batch_size == 256
    assert (cli.fraction("0"), cli.fraction("1"), cli.non_negative_float("0")) == (0.0, 1.0, 0.0)


def test_a_soak_whose_images_all_fit_in_the_cache_is_refused(capsys):
    from mnv3 import soak

    args = soak.get_args_parser().parse_args(["--distinct", "8", "--cache-size", "32"])
    with pytest.raises(SystemExit) as exit:
        soak.main(args)
    assert exit.value.code == 2
    assert capsys.readouterr().err.strip() == (
        "error: --distinct 8 must be more than --cache-size 32: with every image cached, the cache never evicts, "
        "which is what the soak is for"
    )


def test_a_concurrency_above_the_requests_is_lowered_to_them_and_said(capsys):
    # at most --requests are ever in flight: the row would record a concurrency the run never had
    args = cli.fill_load_defaults(
        fastapi_serving.get_args_parser().parse_args(["--concurrency", "8", "--requests", "3"])
    )
    assert (args.concurrency, args.requests) == (3, 3)
    assert "measuring at concurrency 3" in capsys.readouterr().out


def test_a_load_test_none_of_whose_requests_was_answered_writes_nothing(tmp_path, capsys):
    # every request over --deadline-ms: a row of 0 req/s replaced the last run's results, and the stage exited 0
    (tmp_path / "03.csv").write_text("the last run's\n")
    failed = {"ok": 0, "errors": 32, "errors_by_status": "504:32"}
    with pytest.raises(cli.UsageError, match=r"no request was answered \(errors by status: 504:32\)"):
        cli.write_results(tmp_path, "03.csv", [failed])
    assert (tmp_path / "03.csv").read_text() == "the last run's\n"
    cli.write_results(tmp_path, "03.csv", [failed, failed | {"ok": 1}])  # one answered: the run measured something
    assert (tmp_path / "03.csv").read_text() != "the last run's\n"


def test_labels_count_without_labels_is_refused_before_the_stage_runs(tmp_path, capsys):
    ran = []
    with pytest.raises(SystemExit) as exit:  # not after loading and re-estimating the model, minutes in
        cli.run_stage(ran.append, SimpleNamespace(labels=None, labels_count=5))
    assert exit.value.code == 2 and not ran
    assert (
        capsys.readouterr().err
        == "error: --labels-count counts --labels photos: pass --labels FILE too, or leave it out\n"
    )
    cli.run_stage(ran.append, SimpleNamespace(labels=None, labels_count=None))
    cli.run_stage(ran.append, SimpleNamespace(labels=tmp_path, labels_count=5))
    assert len(ran) == 2


def test_a_caching_run_whose_cache_cannot_hold_a_phase_is_refused(tmp_path, capsys):
    # its "hits" would be misses, and their speed-up a ratio of two misses
    args = caching.get_args_parser().parse_args(
        ["--quick", "--cache-size", "1", "--results-dir", str(tmp_path), "--artifacts-dir", str(tmp_path)]
    )
    with pytest.raises(SystemExit) as exit:
        caching.main(args)
    assert exit.value.code == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("error: --cache-size 1 holds fewer than the ") and "or leave it unset" in error


def test_a_missing_input_names_the_command_with_the_folders_given(tmp_path):
    from mnv3.artifacts import require

    with pytest.raises(MissingArtifact) as default:
        require("artifacts/none.onnx", 1)
    assert str(default.value).endswith("Run `python baseline_export_quantize.py` first (or `make run` for all stages).")
    with pytest.raises(MissingArtifact) as elsewhere:  # `make run` would write to the default folders instead
        require(tmp_path / "none.onnx", 2, tmp_path / "a", "results")
    assert str(elsewhere.value).endswith(f"Run `python static_quantization.py --artifacts-dir {tmp_path / 'a'}` first.")


def test_a_folder_flag_naming_a_file_says_so_not_to_run_a_stage_into_it(tmp_path):
    from mnv3.artifacts import require

    (tmp_path / "notes.txt").write_text("")
    with pytest.raises(MissingArtifact) as refused:  # was "... not found: it is written by stage 2. Run `...`"
        require(tmp_path / "notes.txt" / "static_int8.onnx", 2, tmp_path / "notes.txt", tmp_path)
    assert str(refused.value) == f"--artifacts-dir {tmp_path / 'notes.txt'} is a file: pass the folder stage 2 wrote to"
    with pytest.raises(MissingArtifact, match=r"^--results-dir \S+ is a file: pass the folder stage 1 wrote to$"):
        require(tmp_path / "notes.txt" / "01_baseline.csv", 1, tmp_path, tmp_path / "notes.txt")


def test_every_installed_command_runs_as_its_wrapper_calls_it(monkeypatch, capsys):
    """pip's wrapper for a [project.scripts] entry calls the function with no arguments."""
    from importlib.metadata import entry_points

    commands = [ep for ep in entry_points(group="console_scripts") if ep.value.startswith("mnv3.")]
    assert {ep.name for ep in commands} == {"mnv3-serve", "mnv3-ray-serve"}
    for command in commands:
        if command.name == "mnv3-ray-serve":
            pytest.importorskip("ray", reason="Ray Serve is optional: pip install -r requirements-ray.txt")
        monkeypatch.setattr("sys.argv", [command.name, "--help"])
        with pytest.raises(SystemExit) as exit:
            command.load()()
        assert exit.value.code == 0 and capsys.readouterr().out.startswith("usage: "), command.name


def test_quick_mode_exports_the_same_model_as_a_full_run():
    # A model of its own (BatchNorm re-estimated on fewer photos) made a smoke run of stage 1 on the default
    # artifacts/ remove every stage-2 file built from the real one.
    assert cli.QUICK.bn_recalibration_images == cli.FULL.bn_recalibration_images
