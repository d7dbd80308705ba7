"""Shared fixtures. Nothing here downloads: models are seeded random-init MobileNetV3-Large exports."""
import pytest


@pytest.fixture(scope="session")
def fp32_model_dir(tmp_path_factory):
    """A directory with a real batch-dynamic MobileNetV3-Large ONNX export and its class names."""
    import torch
    from torchvision.models import mobilenet_v3_large

    from mnv3.artifacts import CLASS_NAMES_JSON, FP32_ONNX
    from mnv3.model import export_onnx, recalibrate_batchnorm
    from mnv3.photos import CALIBRATION_SOURCES, augmented_views

    torch.manual_seed(0)
    model = recalibrate_batchnorm(mobilenet_v3_large(weights=None), augmented_views(CALIBRATION_SOURCES, 16, 0))
    directory = tmp_path_factory.mktemp("fp32_model")
    export_onnx(model, directory / FP32_ONNX, directory / CLASS_NAMES_JSON)
    return directory


@pytest.fixture(scope="session")
def fp32_model_path(fp32_model_dir):
    from mnv3.artifacts import FP32_ONNX

    return fp32_model_dir / FP32_ONNX
