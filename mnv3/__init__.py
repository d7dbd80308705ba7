"""mnv3: MobileNetV3-Large made fast on CPUs (ONNX, INT8) and served over HTTP."""
