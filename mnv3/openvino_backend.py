"""The optional OpenVINO backend: the same ONNX file, run by OpenVINO's CPU plugin.

`OpenVINOSession` answers the few calls `Engine` makes of an onnxruntime session (`run`, `get_inputs`,
`get_outputs`, `get_providers`), so the engine's validation, softmax and error handling are the same for
both runtimes. Only this module imports openvino, and only `Engine.load(..., backend="openvino")` and
stage 1 import this module: onnxruntime stays the one hard dependency.

Batch sizes: a model with a dynamic batch axis is compiled twice, at load time: reshaped to a static batch
of 1, and kept dynamic for every other size the batcher makes. The dynamic model is noticeably slower
than a static one at batch 1, and barely at larger batches, while each compiled model costs memory and a
compile stall. So one per batch size (up to `max_batch_size` of them) is not worth it; batch 1, which is
what every request runs at under light load, is.

Streams: with `streams` > 1 the dynamic-batch model is compiled for that many CPU streams (the threads
split between them) and a batch is cut into that many parts that run at once, one infer request each:
fewer threads per convolution synchronise less. The batch-1 model keeps one stream with every thread.
"""

import threading
from typing import NamedTuple

import numpy as np
import openvino as ov

PRECISIONS = ("auto", "f32", "bf16")
DEVICE = "CPU"


class Port(NamedTuple):
    """What `Engine` reads of an onnxruntime NodeArg: a name and a shape (a dynamic dim is a string)."""

    name: str
    shape: list


def bf16_supported(core: ov.Core | None = None) -> bool:
    """The CPU plugin runs BF16 natively here (AVX512_BF16 or AMX); otherwise BF16 would be emulated, and slower."""
    return "BF16" in (core or ov.Core()).get_property(DEVICE, "OPTIMIZATION_CAPABILITIES")


class OpenVINOSession:
    """The file compiled for the CPU: a static batch-1 model plus a dynamic-batch one (just the file's own
    shape when its batch axis is fixed; no dynamic one when `max_batch_size` is 1). Calls take turns."""

    def __init__(
        self, path, threads: int, precision: str = "auto", max_batch_size: int | None = None, streams: int = 1
    ):
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
        core = ov.Core()
        if precision == "auto":
            precision = "bf16" if bf16_supported(core) else "f32"
        model = core.read_model(str(path))
        self.precision = precision
        settings = {
            "INFERENCE_NUM_THREADS": threads,
            "NUM_STREAMS": 1,
            "PERFORMANCE_HINT": "LATENCY",
            "INFERENCE_PRECISION_HINT": precision,
        }
        self._batch_1 = self._any_batch = None
        shape = model.inputs[0].partial_shape  # Engine refuses files with other than one input, after this
        if shape.rank.is_static and shape.rank.get_length() > 0 and shape[0].is_dynamic:
            batch_1 = model.clone()
            batch_1.reshape({0: [1, *shape[1:]]})
            self._batch_1 = core.compile_model(batch_1, DEVICE, settings).create_infer_request()
        if self._batch_1 is None or max_batch_size != 1:
            if streams > 1:
                settings |= {"NUM_STREAMS": streams, "PERFORMANCE_HINT": "THROUGHPUT"}
            compiled = core.compile_model(model, DEVICE, settings)
            self._any_batch = [compiled.create_infer_request() for _ in range(streams)]
        self._lock = threading.Lock()  # an infer request runs one call at a time
        self._inputs = [_port(p) for p in model.inputs]
        self._outputs = [_port(p) for p in model.outputs]

    def run(self, output_names, feeds: dict) -> list[np.ndarray]:
        """onnxruntime's call shape: all outputs for one input feed (`output_names` must be None)."""
        assert output_names is None, "only all outputs are supported"
        (batch,) = feeds.values()
        if len(batch) == 1 and self._batch_1 is not None:
            requests, parts = [self._batch_1], [batch]
        elif self._any_batch is None:
            raise ValueError(f"compiled for batch 1 only (max_batch_size=1), got a batch of {len(batch)}")
        else:
            parts = np.array_split(batch, min(len(batch), len(self._any_batch)))
            requests = self._any_batch[: len(parts)]
        with self._lock:
            # share_inputs: no copy of the batch in; outputs are copied out, the requests reuse their buffers.
            for request, part in zip(requests, parts, strict=True):
                request.start_async({0: np.ascontiguousarray(part)}, share_inputs=True)
            for request in requests:
                request.wait()
            return [
                np.concatenate([request.get_output_tensor(i).data for request in requests])
                for i in range(len(self._outputs))
            ]

    def get_inputs(self) -> list[Port]:
        return self._inputs

    def get_outputs(self) -> list[Port]:
        return self._outputs

    def get_providers(self) -> list[str]:
        """For /model: runtime, device and the precision it computes in, e.g. 'OpenVINO:CPU:f32'."""
        return [f"OpenVINO:{DEVICE}:{self.precision}"]


def _port(port) -> Port:
    return Port(port.get_any_name(), [d.get_length() if d.is_static else "?" for d in port.partial_shape])
