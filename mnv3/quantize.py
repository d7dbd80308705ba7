"""INT8 quantization with onnxruntime: dynamic (stage 1) and static from calibration photos (stage 2).

A static recipe is a small dataclass so a better one can be added to RECIPES and picked with --recipe,
and so the manifest and CSVs record exactly what produced static_int8.onnx.
"""
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from onnxruntime.quantization import (CalibrationDataReader, CalibrationMethod, QuantFormat, QuantType,
                                      quantize_dynamic, quantize_static)
from onnxruntime.quantization.shape_inference import quant_pre_process
from PIL import Image
from tqdm import tqdm

from mnv3.photos import fill_calibration_dir, list_images
from mnv3.preprocess import preprocess_batch

CALIBRATION_BATCH_SIZE = 8


@dataclass
class StaticRecipe:
    """Arguments to quantize_static, as names (QuantFormat/QuantType/CalibrationMethod members)."""
    quant_format: str = "QDQ"
    per_channel: bool = True
    activation_type: str = "QUInt8"
    weight_type: str = "QInt8"
    calibrate_method: str = "MinMax"
    reduce_range: bool = False
    nodes_to_exclude: tuple[str, ...] = ()
    op_types_to_quantize: tuple[str, ...] = ()  # empty: every op type ORT can quantize
    extra_options: dict = field(default_factory=dict)

    def record(self) -> dict:
        """JSON/CSV-friendly description for the manifest and results."""
        return asdict(self) | {"nodes_to_exclude": list(self.nodes_to_exclude),
                               "op_types_to_quantize": list(self.op_types_to_quantize)}


# QDQ, per-channel S8 weights, U8 activations, MinMax: ORT's recommended CPU starting point.
# reduce_range (7-bit weights) because without VNNI the U8xS8 kernels saturate their int16 sums: on an
# AVX2-only CPU, logits SQNR vs FP32 went from 7.5 dB to 11.2 dB with it, while in float-simulated
# QDQ (no saturation) it cost only 0.35 dB, so it is the safe default on any x86 CPU.
RECIPES = {
    "qdq_per_channel_minmax": StaticRecipe(reduce_range=True),
}
DEFAULT_RECIPE = "qdq_per_channel_minmax"


def pre_process(fp32_path, out_path) -> Path:
    """ORT's recommended step before quantizing: shape inference plus graph optimisation (BN folding...)."""
    quant_pre_process(str(fp32_path), str(out_path))
    return Path(out_path)


def quantize_dynamic_int8(fp32_path, out_path) -> Path:
    """INT8 weights, activations quantized on the fly per call (DynamicQuantizeLinear + ConvInteger)."""
    with tempfile.TemporaryDirectory() as tmp:
        prepared = pre_process(fp32_path, Path(tmp) / "prepared.onnx")
        quantize_dynamic(str(prepared), str(out_path), weight_type=QuantType.QInt8)
    return Path(out_path)


def calibration_photos(folder, count: int) -> list[Path]:
    """Up to `count` calibration images from `folder`, generating them if it has none.

    Generated images left by a smaller earlier run (say --quick) are regenerated rather than silently
    calibrating on fewer photos than asked for; images a user put there are never touched.
    """
    existing = list_images(folder) if Path(folder).is_dir() else []
    if existing and len(existing) < count and all(p.name.startswith("generated_") for p in existing):
        for path in existing:
            path.unlink()
    return fill_calibration_dir(folder, count)[:count]


class PhotoCalibrationReader(CalibrationDataReader):
    """Feeds calibration photos through the serving preprocessing, a few images per call."""

    def __init__(self, image_paths, input_name: str = "input", batch_size: int = CALIBRATION_BATCH_SIZE):
        self.chunks = [image_paths[i:i + batch_size] for i in range(0, len(image_paths), batch_size)]
        self.input_name = input_name
        self.progress = tqdm(total=len(image_paths), desc="calibration", unit="img", leave=False)

    def get_next(self):
        if not self.chunks:
            self.progress.close()
            return None
        chunk = self.chunks.pop(0)
        batch = preprocess_batch([_open_rgb(path) for path in chunk])
        self.progress.update(len(chunk))
        return {self.input_name: batch}


def _open_rgb(path) -> Image.Image:
    with Image.open(path) as image:
        return image.convert("RGB")


def quantize_static_int8(fp32_path, out_path, image_paths, recipe: StaticRecipe) -> Path:
    with tempfile.TemporaryDirectory() as tmp:
        prepared = pre_process(fp32_path, Path(tmp) / "prepared.onnx")
        quantize_static(
            str(prepared), str(out_path), PhotoCalibrationReader(list(image_paths)),
            quant_format=QuantFormat[recipe.quant_format],
            per_channel=recipe.per_channel,
            activation_type=QuantType[recipe.activation_type],
            weight_type=QuantType[recipe.weight_type],
            calibrate_method=CalibrationMethod[recipe.calibrate_method],
            reduce_range=recipe.reduce_range,
            nodes_to_exclude=list(recipe.nodes_to_exclude) or None,
            op_types_to_quantize=list(recipe.op_types_to_quantize) or None,
            # Not CalibMaxIntermediateOutputs: in ORT 1.32 it drops the batches it flushes instead of
            # merging their ranges, and MinMax only keeps per-tensor min/max anyway, so memory is small.
            extra_options=recipe.extra_options,
        )
    return Path(out_path)


def size_mb(path) -> float:
    return round(Path(path).stat().st_size / 1e6, 3)

