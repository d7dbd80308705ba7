"""mnv3: MobileNetV3 (Large or Small, ImageNet or your own fine-tune) made fast on CPUs and served over HTTP.

Importing mnv3 (before openvino or nncf) keeps their usage telemetry out of the process unless its user said
yes to it. `import openvino` imports its model converter, which counts a missing answer (no consent file in
~/intel) as consent and sends usage events to Google Analytics (and writes ~/intel/stats) from every server,
replica and stage that imports it; mnv3 counts a missing answer as no. Both libraries fall back to their own
no-op stubs when `openvino_telemetry` cannot be imported, which a None in sys.modules makes so. A consent file
saying yes (`opt_in_out --opt_in`) leaves them as they are, and so does a program that imported openvino or
nncf before mnv3 (their import has sent its event by then).

onnxruntime (since 1.29) reports to Microsoft from Linux and macOS too: a process-start event, then session,
model and error events, with a device id written to ~/.cache/Microsoft/DeveloperTools/.onnxruntime. Its
documented full opt-out, ORT_DISABLE_TELEMETRY=1, is set here unless the variable is already set (a user's own
choice either way stands). `import onnxruntime` itself records the first event, so a program that imported it
before mnv3 has sent that by then.
"""

import os
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

try:
    __version__ = version("mnv3")  # pyproject.toml's, as installed (`pip install -e .` in a checkout)
except PackageNotFoundError:  # a checkout on sys.path that was never installed
    __version__ = "0+unknown"


def _said_yes_to_openvino_telemetry() -> bool:
    """Whether openvino_telemetry's consent file (where its opt_in_out tool writes it) holds a yes."""
    try:
        base = (
            Path(os.environ["LOCALAPPDATA"], "Intel Corporation") if sys.platform == "win32" else Path.home() / "intel"
        )
        return (base / "openvino_telemetry").read_bytes().partition(b"\n")[0].strip() == b"1"  # as the tool reads it
    except (KeyError, OSError, RuntimeError):  # no home, no file, unreadable: no answer
        return False


if not _said_yes_to_openvino_telemetry():
    sys.modules.setdefault("openvino_telemetry", None)  # type: ignore[arg-type]
os.environ.setdefault("ORT_DISABLE_TELEMETRY", "1")
