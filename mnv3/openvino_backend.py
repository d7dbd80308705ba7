"""The optional OpenVINO backend: an ONNX file or an OpenVINO IR (stage 2's NNCF builds), run by OpenVINO's CPU plugin.

`OpenVINOSession` answers the few calls `Engine` makes of an onnxruntime session (`run`, `get_inputs`,
`get_outputs`, `get_providers`), so the engine's validation, softmax and error handling are the same for
both runtimes. This module imports openvino at its top, so it is itself imported lazily (by
`engine.open_session` with backend "openvino"); the other modules that use openvino (stage 2's NNCF builds
in openvino_int8, its profiles and peaks in profiling and silicon) import it inside the functions that
need it: onnxruntime stays the one hard dependency.

Batch sizes: every model is compiled for a static shape; a dynamic batch axis is not, as OpenVINO's CPU
plugin runs a dynamic shape noticeably slower than a static one, most of all for INT8 files. A batch of
exactly one runs on a model compiled for batch 1 with every thread (the latency path: what every request
runs at under light load). A larger batch is cut into parts of at most `part_size` images, each part a
power of two (13 = 4 + 4 + 4 + 1), and each part runs on a model compiled for its size. Which part size is
fastest per image depends on the CPU (a few images' activations stay in a core's cache, which a batch
of 32 spills; a matrix unit such as AMX does more per call on a larger part). So stage 2 measures the part size for the
engine it chooses (DEFAULT_PART_SIZE without that), and the compiled models are one per power of two up to
`part_size` (and up to `max_batch_size`), each compiled and run once at load, so no request pays for a
compile or a first allocation. With several streams no part is larger than the batch's share of a stream
(a batch of 16 on 2 streams runs as 8 + 8, not as one part of 16 that leaves a stream idle).

Threads and streams: the batch-1 model runs on `threads` threads, one stream. The part models run on
`batch_threads` threads (default: `threads`); with `streams` > 1 they are compiled for that many CPU
streams (at most one a thread, the threads split between them), and the parts of a batch run at once,
each on an infer request of its own: fewer threads per convolution synchronise less. A server gives its
batches fewer threads than the machine has: under load the next images are decoded while a batch runs,
and a batch that takes every core takes them from the decoding, in bursts.
"""

import functools
import logging
import math
import threading
from typing import NamedTuple

import numpy as np
import openvino as ov

log = logging.getLogger(__name__)

PRECISIONS = ("auto", "f32", "bf16")
# The largest part a batch is cut into unless stage 2 measured another for this CPU (see above).
DEFAULT_PART_SIZE = 4
DEVICE = "CPU"


class Port(NamedTuple):
    """What `Engine` reads of an onnxruntime NodeArg: a name and a shape (a dynamic dim is a string)."""

    name: str
    shape: list


@functools.cache
def shared_core() -> ov.Core:
    """The process's one OpenVINO Core, kept for its life. With a Core per session, freeing the last session
    also freed the last Core and OpenVINO unloaded its CPU plugin: a SIGTERM to the process after that was a
    segfault (seen in the test suite on a stage's SIGTERM path, once dropped sessions were really freed)."""
    return ov.Core()


def bf16_supported() -> bool:
    """The CPU plugin runs BF16 natively here (AVX512_BF16 or AMX); otherwise BF16 would be emulated, and slower."""
    return "BF16" in shared_core().get_property(DEVICE, "OPTIMIZATION_CAPABILITIES")


def latency_config(threads: int, precision: str) -> dict:
    """The CPU plugin's settings for one call at a time on one stream of `threads` threads, computing what is
    not quantized in `precision` (f32 or bf16)."""
    return {
        "INFERENCE_NUM_THREADS": threads,
        "NUM_STREAMS": 1,
        "PERFORMANCE_HINT": "LATENCY",
        "INFERENCE_PRECISION_HINT": precision,
    }


class OpenVINOSession:
    """The file compiled for the CPU at static batch sizes (see the module docstring): batch 1, and the
    powers of two up to `part_size` for the parts of larger batches (none when `max_batch_size` is 1).
    A file whose batch axis is fixed is compiled at that size alone. Calls take turns."""

    def __init__(
        self,
        path,
        threads: int,
        precision: str = "auto",
        max_batch_size: int | None = None,
        streams: int = 1,
        batch_threads: int | None = None,
        part_size: int | None = None,
    ):
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
        core = shared_core()
        if precision == "auto":
            precision = "bf16" if bf16_supported() else "f32"
        model = core.read_model(str(path))
        self.precision = precision
        self.batch_threads = batch_threads or threads
        if streams > self.batch_threads:
            log.info(
                "%s: %d streams asked for, batches run on %d thread(s): %d stream(s)",
                path,
                streams,
                self.batch_threads,
                self.batch_threads,
            )
            streams = self.batch_threads
        latency = latency_config(threads, precision)  # a single image: every thread, one stream
        parts = latency_config(self.batch_threads, precision)
        if streams > 1:
            parts |= {"NUM_STREAMS": streams, "PERFORMANCE_HINT": "THROUGHPUT"}
        # Two infer requests a stream: one is fed while the other runs, so a stream never waits for Python.
        jobs = 2 * streams
        self._inputs = [_port(p) for p in model.inputs]
        self._outputs = [_port(p) for p in model.outputs]
        shape = model.inputs[0].partial_shape  # Engine refuses files with other than one input, after this
        self._alone: ov.InferRequest | None = None
        self._parts: dict[int, ov.AsyncInferQueue] = {}
        self._compiled: dict[int, ov.CompiledModel] = {}  # each part size's, to build its queue anew
        self._jobs = jobs
        self._outputs_in_progress = _CallOutputs()
        if shape.rank.is_static and shape.rank.get_length() > 0 and shape[0].is_dynamic:
            alone = core.compile_model(at_batch(model, 1), DEVICE, latency)
            self._alone = alone.create_infer_request()
            part_size = part_size or DEFAULT_PART_SIZE  # None: stage 2 measured none for this file
            largest = min(part_size, max_batch_size or part_size)
            sizes = [1 << k for k in range(largest.bit_length()) if max_batch_size != 1]
        else:
            sizes = [shape[0].get_length() if shape.rank.is_static and shape.rank.get_length() > 0 else 1]
        # each output's row shape and type (static here)
        self._output_rows: list[tuple[tuple, np.dtype]] = _output_rows(alone) if self._alone else []
        for size in sizes:
            # A file fixed at one image is the single-image path: every thread, as the batch-1 model.
            config = parts if self._alone or size > 1 else latency
            compiled = core.compile_model(at_batch(model, size) if self._alone else model, DEVICE, config)
            self._compiled[size] = compiled
            self._parts[size] = self._queue(compiled)
            self._output_rows = _output_rows(compiled)
        if not any(size > 1 for size in sizes):  # nothing but single images: they run on every thread
            self.batch_threads = threads
        self.streams = streams
        self._lock = threading.Lock()  # one call at a time: parts write into that call's outputs
        self._warm_up()

    def run(self, output_names, feeds: dict) -> list[np.ndarray]:
        """onnxruntime's call shape: all outputs for one input feed (`output_names` must be None)."""
        assert output_names is None, "only all outputs are supported"
        (batch,) = feeds.values()
        batch = np.ascontiguousarray(batch)
        with self._lock:
            if self._alone is not None and (len(batch) == 1 or not self._parts):
                # A single image, or a batch when compiled for single images only (max_batch_size 1): one at a time.
                # share_inputs: no copy of the batch in; outputs are copied out, the request reuses its buffers.
                out = self._new_outputs(len(batch))
                for row in range(len(batch)):
                    self._alone.infer({0: batch[row : row + 1]}, share_inputs=True)
                    for i, rows in enumerate(out):
                        rows[row] = self._alone.get_output_tensor(i).data[0]
                return out
            if not self._parts:  # a file of one batch size, whose queue could not be rebuilt (logged)
                raise ValueError("no OpenVINO queue is left to run this file's batches")
            sizes = split_batch(len(batch), self._parts, self.streams)
            out = self._outputs_in_progress.arrays = self._new_outputs(len(batch))
            offset = 0
            try:
                for size in sizes:
                    # Each part is a view of the batch (contiguous rows), read in place by its request.
                    self._parts[size].start_async({0: batch[offset : offset + size]}, offset, share_inputs=True)
                    offset += size
            except Exception:
                # A request whose start_async raised never goes back to its queue's idle requests (OpenVINO's
                # AsyncInferQueue), so after as many failures as the queue has requests every later call would
                # wait forever. The parts already started finish (none writes into a later call's outputs), and
                # the failed part's queue is built anew (and warmed up, as every queue is at start), even if waiting
                # for the others fails too.
                for queued in set(sizes):
                    try:
                        self._parts[queued].wait_all()
                    except Exception as exc:  # the caller gets the first failure, start_async's
                        log.error("a batch part failed while another could not start: %s", exc)
                try:
                    self._parts[size] = queue = self._queue(self._compiled[size])
                    self._warm(queue[j] for j in range(len(queue)))
                except Exception as exc:  # no queue that may hang: batches are cut into the other sizes
                    del self._parts[size]
                    log.error(
                        "parts of %d images no longer run: their OpenVINO queue could not be rebuilt: %s", size, exc
                    )
                raise
            for size in set(sizes):
                self._parts[size].wait_all()
            return out

    def _new_outputs(self, images: int) -> list[np.ndarray]:
        return [np.empty((images, *shape), dtype) for shape, dtype in self._output_rows]

    def _queue(self, compiled: ov.CompiledModel) -> ov.AsyncInferQueue:
        queue = ov.AsyncInferQueue(compiled, self._jobs)
        # Not a method of the session: the queue holds its callback in C++, where the garbage collector cannot
        # see the cycle, so a session its queues held would never be freed (its plugin threads and memory).
        queue.set_callback(self._outputs_in_progress.copy_out)
        return queue

    def _warm_up(self) -> None:
        """One run on every infer request, so no request pays for the plugin's first allocations."""
        alone = [self._alone] if self._alone is not None else []
        self._warm(alone + [queue[j] for queue in self._parts.values() for j in range(len(queue))])

    @staticmethod
    def _warm(requests) -> None:
        for request in requests:
            tensor = request.get_input_tensor()
            request.infer({0: np.zeros(tensor.shape, dtype=tensor.element_type.to_dtype())})

    def get_inputs(self) -> list[Port]:
        return self._inputs

    def get_outputs(self) -> list[Port]:
        return self._outputs

    def get_providers(self) -> list[str]:
        """For /model: runtime, device and the precision it computes in, e.g. 'OpenVINO:CPU:f32'."""
        return [f"OpenVINO:{DEVICE}:{self.precision}"]


class _CallOutputs:
    """The outputs of the call in progress, which its parts' callbacks fill in, each its rows."""

    def __init__(self) -> None:
        self.arrays: list[np.ndarray] = []

    def copy_out(self, request: ov.InferRequest, offset: int) -> None:
        """A part's callback: its rows of every output, copied out of the request's reused buffers."""
        for i, out in enumerate(self.arrays):
            rows = request.get_output_tensor(i).data
            out[offset : offset + len(rows)] = rows


def _output_rows(compiled: ov.CompiledModel) -> list[tuple[tuple, np.dtype]]:
    return [(tuple(o.get_shape())[1:], o.get_element_type().to_dtype()) for o in compiled.outputs]


def split_batch(rows: int, sizes, streams: int = 1) -> list[int]:
    """`rows` as parts of the compiled `sizes`, largest first (13 with 1, 2, 4: 4, 4, 4, 1), none larger than a
    stream's share of the rows where a smaller size exists (16 with 1, 2, 4, 8, 16 on 2 streams: 8, 8)."""
    share = math.ceil(rows / streams)
    fitting = [size for size in sizes if size <= share]
    parts = []
    for size in sorted(fitting or sizes, reverse=True):
        parts += [size] * (rows // size)
        rows %= size
    if rows:
        raise ValueError(f"a batch of {sum(parts) + rows} cannot be cut into the compiled sizes {sorted(sizes)}")
    return parts


def at_batch(model: ov.Model, size: int) -> ov.Model:
    """A copy of `model` whose input has a static batch axis of `size`."""
    static = model.clone()
    static.reshape({0: [size, *model.inputs[0].partial_shape[1:]]})
    return static


def _port(port) -> Port:
    return Port(port.get_any_name(), [d.get_length() if d.is_static else "?" for d in port.partial_shape])
