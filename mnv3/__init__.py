"""mnv3: MobileNetV3 (Large or Small, ImageNet or your own fine-tune) made fast on CPUs and served over HTTP.

Importing mnv3 keeps OpenVINO's and NNCF's usage telemetry out of the process: `import openvino` imports its
model converter, which, with no consent file in ~/intel, counts as consent and sends usage events to Google
Analytics (and writes ~/intel/stats) on every start of a server, replica or stage. Both libraries fall back to
their own no-op stubs when `openvino_telemetry` cannot be imported, which a None in sys.modules makes so.
"""

import sys

sys.modules.setdefault("openvino_telemetry", None)  # type: ignore[arg-type]
