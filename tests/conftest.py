"""Shared fixtures. Nothing here downloads: models are seeded random-init MobileNetV3 exports."""
import pytest


def export_random_init(arch: str, directory):
    """`directory` with a batch-dynamic ONNX export of torchvision's `arch`, seeded random init with
    BatchNorm re-estimated on photos, and its class names."""
    import torch
    import torchvision.models

    from mnv3.artifacts import FP32_ONNX, write_class_names
    from mnv3.model import IMAGENET_CLASSES, export_onnx, recalibrate_batchnorm
    from mnv3.photos import CALIBRATION_SOURCES, augmented_views

    torch.manual_seed(0)
    model = recalibrate_batchnorm(getattr(torchvision.models, arch)(weights=None),
                                  augmented_views(CALIBRATION_SOURCES, 16, 0))
    export_onnx(model, directory / FP32_ONNX)
    write_class_names(directory, IMAGENET_CLASSES)
    return directory


@pytest.fixture(scope="session")
def fp32_model_dir(tmp_path_factory):
    """A directory with a real batch-dynamic MobileNetV3-Large ONNX export and its class names."""
    return export_random_init("mobilenet_v3_large", tmp_path_factory.mktemp("fp32_model"))


@pytest.fixture(scope="session")
def fp32_model_path(fp32_model_dir):
    from mnv3.artifacts import FP32_ONNX

    return fp32_model_dir / FP32_ONNX


@pytest.fixture(scope="session")
def fp32_small_model_path(tmp_path_factory):
    """The same for MobileNetV3-Small, whose depthwise channel counts differ from Large's."""
    from mnv3.artifacts import FP32_ONNX

    return export_random_init("mobilenet_v3_small", tmp_path_factory.mktemp("fp32_small_model")) / FP32_ONNX


@pytest.fixture(scope="session")
def held_out():
    """32 preprocessed photos none of the calibration sets use."""
    from mnv3.photos import held_out_images
    from mnv3.preprocess import preprocess_batch

    return preprocess_batch(held_out_images(32))
