"""The serving path must run where torch is not installed: build the app, serve one image, look."""

import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration

SERVE_ONE_IMAGE = """
import io, sys
from fastapi.testclient import TestClient
from PIL import Image
from mnv3.config import ServerConfig
from mnv3.server import create_app

image = io.BytesIO()
Image.new("RGB", (320, 240), "orange").save(image, format="JPEG")
with TestClient(create_app(ServerConfig(model=sys.argv[1], max_batch_size=2))) as client:
    response = client.post("/predict", files={"file": ("a.jpg", image.getvalue(), "image/jpeg")})
    assert response.status_code == 200, response.text
print("torch imported:", "torch" in sys.modules)
"""


def test_serving_never_imports_torch(fp32_model_path):
    result = subprocess.run(
        [sys.executable, "-c", SERVE_ONE_IMAGE, str(fp32_model_path)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("torch imported: False")


def test_serving_sends_no_onnxruntime_telemetry(fp32_model_path, tmp_path):
    # onnxruntime (since 1.29) reports to Microsoft from Linux too, keeping a device id under ~/.cache; importing
    # mnv3 sets its opt-out, ORT_DISABLE_TELEMETRY=1, unless the user set the variable.
    home = tmp_path / "home"  # a fresh home, as on a new machine or container
    home.mkdir()
    serve = SERVE_ONE_IMAGE.replace("max_batch_size=2", "max_batch_size=2, backend='onnxruntime'")
    env = {"PATH": "/usr/bin:/bin", "HOME": str(home)}
    result = subprocess.run(
        [sys.executable, "-c", serve, str(fp32_model_path)], capture_output=True, text=True, timeout=60, env=env
    )
    assert result.returncode == 0, result.stderr
    assert list(home.rglob("*")) == []  # without the opt-out: .cache/Microsoft/DeveloperTools/.onnxruntime/deviceid
    said = "import os, mnv3; print(os.environ['ORT_DISABLE_TELEMETRY'])"
    for own in ("0", "1"):
        chosen = env | {"ORT_DISABLE_TELEMETRY": own}
        result = subprocess.run([sys.executable, "-c", said], capture_output=True, text=True, timeout=60, env=chosen)
        assert result.stdout.strip() == own, result.stderr


def test_the_version_of_a_checkout_never_installed():
    # mnv3.__version__ is the installed package's (GET /v2, /openapi.json); a checkout on sys.path alone has none
    code = (
        "import importlib.metadata as metadata\n"
        "def missing(name): raise metadata.PackageNotFoundError(name)\n"
        "metadata.version = missing\n"
        "import mnv3; print(mnv3.__version__)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert (result.returncode, result.stdout.strip()) == (0, "0+unknown"), result.stderr
