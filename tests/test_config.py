"""Server settings: several --model specs (NAME=PATH@BACKEND), their names, and MNV3_MODEL for one model."""

import sys
from dataclasses import fields
from pathlib import Path

import pytest

from mnv3.config import ModelSpec, ServerConfig, command_name, flag, parse_args, unknown_variables
from mnv3.errors import REJECTION_REASONS

README = Path(__file__).parent.parent / "README.md"

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    "text, name, path, backend",
    [
        ("artifacts/fp32.onnx", "fp32", "artifacts/fp32.onnx", None),
        ("int8=artifacts/static_int8.onnx", "int8", "artifacts/static_int8.onnx", None),
        ("artifacts/fp32.onnx@openvino", "fp32", "artifacts/fp32.onnx", "openvino"),
        ("bf16=artifacts/fp32.onnx@openvino", "bf16", "artifacts/fp32.onnx", "openvino"),
        ("runs/a=b/fp32.onnx", "fp32", "runs/a=b/fp32.onnx", None),  # '=' inside a directory name: all path
        ("models/v1@2024.onnx", "v1@2024", "models/v1@2024.onnx", None),  # '@' before no backend: all path
    ],
)
def test_model_spec_forms(text, name, path, backend):
    assert ModelSpec.parse(text) == ModelSpec(name, Path(path), backend)


def test_repeated_model_flags_serve_several_the_first_the_default():
    config = parse_args(["--model", "a.onnx", "--model", "b=x/a.onnx@openvino", "--backend", "onnxruntime"], {})
    assert [(m.name, str(m.path), config.backend_of(m)) for m in config.models] == [
        ("a", "a.onnx", "onnxruntime"),
        ("b", "x/a.onnx", "openvino"),
    ]
    assert str(config.model) == "a.onnx"  # the default model, as one-model code reads it


def test_the_environment_gives_one_model_and_a_flag_replaces_it():
    assert [m.name for m in parse_args([], {"MNV3_MODEL": "m.onnx"}).models] == ["m"]
    assert [m.name for m in parse_args(["--model", "n.onnx"], {"MNV3_MODEL": "m.onnx"}).models] == ["n"]
    with pytest.raises(SystemExit):
        parse_args([], {})


@pytest.mark.parametrize(
    "models, message",
    [
        (["a.onnx", "x/a.onnx"], "two models are named 'a'"),
        (["my model.onnx"], "'my model' is not URL-safe: name the model with NAME=my model.onnx"),
        (["a?b=a.onnx"], "'a\\?b' is not URL-safe: a name is a letter or digit"),
    ],
)
def test_duplicate_or_unsafe_names_are_refused(models, message):
    with pytest.raises(ValueError, match=message):
        ServerConfig(model=models[0], extra_models=tuple(models[1:]))


def test_a_variable_that_sets_nothing_is_named_with_the_closest_setting():
    environ = {"MNV3_MODLE": "m.onnx", "MNV3_CACHE_SIZE": "0", "MNV3_API_KEY": "the client's", "MNV3_XYZZY": "1"}
    assert unknown_variables(environ | {"HOME": "/root"}) == [
        "MNV3_MODLE sets nothing, ignored (did you mean MNV3_MODEL?)",
        "MNV3_XYZZY sets nothing, ignored",
    ]


# What Kubernetes' service links give a pod for a Service named mnv3 (port 8000, named http) and one named mnv3-api
SERVICE_LINKS = {
    "MNV3_SERVICE_HOST": "10.96.0.12",
    "MNV3_SERVICE_PORT": "8000",
    "MNV3_SERVICE_PORT_HTTP": "8000",
    "MNV3_PORT": "tcp://10.96.0.12:8000",
    "MNV3_PORT_8000_TCP": "tcp://10.96.0.12:8000",
    "MNV3_PORT_8000_TCP_PROTO": "tcp",
    "MNV3_PORT_8000_TCP_PORT": "8000",
    "MNV3_PORT_8000_TCP_ADDR": "10.96.0.12",
    "MNV3_API_SERVICE_HOST": "10.96.0.13",
    "MNV3_API_PORT": "tcp://10.96.0.13:80",
}


def test_kubernetes_service_links_are_not_settings():
    # MNV3_PORT=tcp://... read as --port refused to start the pod: "is not a valid int"
    config = parse_args([], environ=SERVICE_LINKS | {"MNV3_MODEL": "m.onnx", "MNV3_CACHE_SIZE": "0"})
    assert (config.port, config.cache_size) == (ServerConfig(model="m.onnx").port, 0)
    assert unknown_variables(SERVICE_LINKS | {"MNV3_XYZZY": "1"}) == ["MNV3_XYZZY sets nothing, ignored"]
    # a port of the user's own is one still
    assert parse_args([], environ=SERVICE_LINKS | {"MNV3_MODEL": "m.onnx", "MNV3_PORT": "9000"}).port == 9000


def test_the_log_level_is_read_in_any_case():
    # LOG_LEVEL=INFO, as containers are often configured, exited 2: "must be one of critical, ..., got 'INFO'"
    assert parse_args(["--model", "m.onnx", "--log-level", "DEBUG"]).log_level == "debug"
    assert parse_args([], environ={"MNV3_MODEL": "m.onnx", "MNV3_LOG_LEVEL": "Warning"}).log_level == "warning"
    assert ServerConfig(model="m.onnx", log_level="ERROR").log_level == "error"  # from code, or a Ray config file


def test_a_refused_variable_is_quoted_as_written(capsys):
    with pytest.raises(SystemExit):
        parse_args([], environ={"MNV3_MODEL": "m.onnx", "MNV3_LOG_LEVEL": "Verbose"})
    assert capsys.readouterr().err.endswith("got 'verbose' (from MNV3_LOG_LEVEL=Verbose)\n")


# Each setting's least value, below which it is refused at start-up (0 in-flight or queue places, a top-0
# answer, a 0 ms deadline or body timeout would make every request fail instead).
MINIMUMS = {
    "port": 0,
    "cache_size": 0,
    "batch_window_ms": 0,
    "max_batch_size": 1,
    "max_in_flight": 1,
    "queue_limit": 1,
    "deadline_ms": 1,
    "intra_op_threads": 1,
    "inter_op_threads": 1,
    "batch_threads": 0,
    "preprocess_threads": 1,
    "max_upload_bytes": 1,
    "max_pixels": 1,
    "body_timeout_s": 0.001,
    "shutdown_delay_s": 0,
    "shutdown_timeout_s": 0,
    "keep_alive_s": 0.001,
    "top_k": 1,
    "max_request_images": 0,
}


@pytest.mark.parametrize("setting", MINIMUMS)
def test_a_value_below_a_settings_minimum_is_refused_and_the_minimum_taken(setting):
    least = MINIMUMS[setting]
    below = least - 1 if isinstance(least, int) else least / 2
    assert getattr(ServerConfig(model="a.onnx", **{setting: least}), setting) == least
    with pytest.raises(ValueError, match=f"--{setting.replace('_', '-')} must be at least {least}, got {below}"):
        ServerConfig(model="a.onnx", **{setting: below})


def test_every_bounded_setting_has_its_minimum_pinned():
    assert {f.name for f in fields(ServerConfig) if f.metadata.get("minimum") is not None} == set(MINIMUMS)


def test_the_server_listens_on_this_machine_alone_unless_told_otherwise():
    # 0.0.0.0 by default would put a server without keys on every network the machine is on.
    assert ServerConfig(model="a.onnx").host == "127.0.0.1"


def test_an_empty_host_is_refused_naming_its_variable(capsys):
    with pytest.raises(SystemExit) as exited:
        parse_args([], environ={"MNV3_MODEL": "m.onnx", "MNV3_HOST": ""})
    # uvicorn tried to resolve "": "cannot listen on :8000: Name or service not known", naming no setting
    assert exited.value.code == 2
    assert capsys.readouterr().err == (
        "python -m mnv3.server: error: --host must be an address or a host name (0.0.0.0: every IPv4 interface), "
        "got '' (from MNV3_HOST=)\n"
    )


def test_the_command_name_is_the_console_scripts_when_started_as_one(monkeypatch):
    # mnv3-ray-serve's errors began "python -m mnv3.ray_serve: error:" (test_server.py runs mnv3-serve itself)
    monkeypatch.setattr(sys, "argv", ["/venv/bin/mnv3-ray-serve", "--bogus"])
    assert command_name("python -m mnv3.ray_serve") == "mnv3-ray-serve"
    monkeypatch.setattr(sys, "argv", ["/checkout/mnv3/ray_serve.py", "--bogus"])  # python -m's argv[0]
    assert command_name("python -m mnv3.ray_serve") == "python -m mnv3.ray_serve"


def test_images_per_request_defaults_to_the_batch_size():
    assert ServerConfig(model="a.onnx", max_batch_size=16).images_per_request == 16
    assert ServerConfig(model="a.onnx", max_batch_size=16, max_request_images=4).images_per_request == 4


def test_batch_threads_are_left_to_the_engine_by_default():
    # 0: Engine.load asks its Choice (stage 2's measurement, else half: test_engine_choice_rules.py)
    assert ServerConfig(model="a.onnx", intra_op_threads=8).batch_threads == 0


def test_batch_threads_flag_and_variable():
    assert parse_args(["--model", "a.onnx", "--batch-threads", "2"], environ={}).batch_threads == 2
    assert parse_args(["--model", "a.onnx"], environ={"MNV3_BATCH_THREADS": "3"}).batch_threads == 3
    with pytest.raises(ValueError, match="--batch-threads must be at least 0"):
        ServerConfig(model="a.onnx", batch_threads=-1)


def test_a_batch_size_past_the_maximum_is_refused_before_a_model_loads():
    # 10**7 places had the warm-up's batch fail to allocate, once the server had started
    assert ServerConfig(model="a.onnx", max_batch_size=256).max_batch_size == 256
    with pytest.raises(ValueError, match="--max-batch-size must be at most 256, got 10000000"):
        ServerConfig(model="a.onnx", max_batch_size=10**7)


def test_a_port_past_65535_is_refused_not_wrapped():
    # uvloop would bind 99999 modulo 65536 (34463) while logging 99999
    assert parse_args(["--model", "a.onnx", "--port", "65535"], environ={}).port == 65535
    with pytest.raises(ValueError, match="--port must be at most 65535, got 99999"):
        ServerConfig(model="a.onnx", port=99999)


@pytest.mark.parametrize(
    "setting",
    ["batch_window_ms", "deadline_ms", "body_timeout_s", "shutdown_delay_s", "shutdown_timeout_s", "keep_alive_s"],
)
def test_a_wait_longer_than_a_day_is_refused_before_a_model_loads(setting):
    # --batch-window-ms 1e13 was accepted, then every batch failed with threading's OverflowError
    day = 86_400_000 if setting.endswith("_ms") else 86_400
    assert getattr(ServerConfig(model="a.onnx", **{setting: day}), setting) == day
    with pytest.raises(ValueError, match=f"--{setting.replace('_', '-')} must be at most {day}, got 10000000000000.0"):
        ServerConfig(model="a.onnx", **{setting: 1e13})


@pytest.mark.parametrize("prefix", ["mnv3", "/mnv3/", "/", "https://x/mnv3", "/a b"])
def test_a_root_path_that_is_not_a_path_prefix_is_refused(prefix):
    assert ServerConfig(model="a.onnx", root_path="/api/mnv3").root_path == "/api/mnv3"
    with pytest.raises(ValueError, match="is not a path prefix: write /NAME"):
        ServerConfig(model="a.onnx", root_path=prefix)


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
@pytest.mark.parametrize("setting", ["deadline_ms", "batch_window_ms", "body_timeout_s", "shutdown_timeout_s"])
def test_a_duration_that_is_not_a_finite_number_is_refused(setting, value, capsys):
    # NaN passes every bound (NaN < 1 is False): it started servers that answered every request with a 500
    with pytest.raises(SystemExit) as exit:
        parse_args(["--model", "a.onnx", f"{flag(setting)}={value}"], environ={})
    assert exit.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith(f"{flag(setting)} must be a finite number, got {value}")


def test_a_bad_flag_is_one_line_naming_it_without_the_usage_block(capsys):
    for argv in (["--cache-size", "-1"], ["--cache-size", "abc"], ["--bogus", "1"]):
        with pytest.raises(SystemExit) as exit:
            parse_args(["--model", "a.onnx", *argv], environ={})
        error = capsys.readouterr().err
        assert exit.value.code == 2 and error.count("\n") == 1 and error.startswith("python -m mnv3.server: error: ")
        assert argv[0] in error
    with pytest.raises(SystemExit):
        parse_args(["--model", "a.onnx", "--cache-size", "-1"], environ={}, prog="python -m mnv3.ray_serve")
    assert capsys.readouterr().err.startswith("python -m mnv3.ray_serve: error: --cache-size must be at least 0")


def test_an_error_names_the_variable_when_no_flag_gave_the_value(capsys):
    def error(argv, environ) -> str:
        with pytest.raises(SystemExit):
            parse_args(["--model", "a.onnx", *argv], environ)
        return capsys.readouterr().err.splitlines()[-1]

    assert error([], {"MNV3_CACHE_SIZE": "abc"}).endswith(
        "MNV3_CACHE_SIZE='abc' is not a valid int (it sets --cache-size)"
    )
    assert error([], {"MNV3_CACHE_SIZE": "-1"}).endswith(
        "--cache-size must be at least 0, got -1 (from MNV3_CACHE_SIZE=-1)"
    )
    assert error([], {"MNV3_LOG_LEVEL": "verbose"}).endswith("(from MNV3_LOG_LEVEL=verbose)")
    assert error(["--cache-size", "-2"], {"MNV3_CACHE_SIZE": "-1"}).endswith("--cache-size must be at least 0, got -2")
    # the flag wins over a variable, even a bad one it replaces, and --help works whatever the variables say
    assert parse_args(["--model", "a.onnx", "--cache-size", "3"], {"MNV3_CACHE_SIZE": "-1"}).cache_size == 3
    assert parse_args(["--model", "a.onnx", "--cache-size", "3"], {"MNV3_CACHE_SIZE": "abc"}).cache_size == 3
    with pytest.raises(SystemExit) as help_exit:
        parse_args(["--help"], {"MNV3_PORT": "auto"})
    assert help_exit.value.code == 0 and "MNV3_PORT; auto" in capsys.readouterr().out
    with pytest.raises(SystemExit) as help_exit:  # argparse formats help with %: a value holding one is text
        parse_args(["--help"], {"MNV3_ROOT_PATH": "/a%zb"})
    assert help_exit.value.code == 0 and "MNV3_ROOT_PATH; /a%zb" in capsys.readouterr().out
    assert parse_args(["--model", "a.onnx"], {"MNV3_DEADLINE_MS": "250"}).deadline_ms == 250.0


def test_a_mistyped_backend_after_the_model_file_is_named_as_such(tmp_path):
    with pytest.raises(
        ValueError, match=r"unknown backend 'tensorrt' after the '@' of .*/fp32.onnx@tensorrt: one of auto"
    ):
        ServerConfig(model=f"{tmp_path}/fp32.onnx@tensorrt")
    named = tmp_path / "v1@beta"  # a file that really is named so is a path
    named.touch()
    assert ServerConfig(model=f"v1={named}").models[0].path == named


def test_the_readme_documents_every_server_flag_and_rejection_reason():
    # A new setting or refusal is a flag or a metric label a user meets: nothing else says it needs documenting
    readme = README.read_text()
    undocumented = [
        flag(f.name) for f in fields(ServerConfig) if f.name != "extra_models" and f"`{flag(f.name)}" not in readme
    ]
    assert undocumented == [], "add them to the README's server flags (and the limits table, for a limit)"
    unnamed = [reason for reason in REJECTION_REASONS if f"`{reason}`" not in readme]
    assert unnamed == [], "name them in the README where mnv3_rejections_total's reasons are"
