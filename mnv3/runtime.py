"""The one place onnxruntime sessions are made, with the thread settings serving and measuring share.

Every session is CPU-only and has explicit intra-/inter-op thread counts, so what ran is what the
results and `/model` record. Serving imports this module, never the benchmark harness.
"""

DEFAULT_INTRA_OP_THREADS = 2  # the machines this project is measured on have 2 cores
DEFAULT_INTER_OP_THREADS = 1


def make_session(
    model_path,
    intra_op_threads: int = DEFAULT_INTRA_OP_THREADS,
    inter_op_threads: int = DEFAULT_INTER_OP_THREADS,
    profile_prefix: str | None = None,
    allow_spinning: bool = True,
):
    """A CPU onnxruntime session with explicit (and therefore recordable) thread settings.

    `allow_spinning=False` makes idle intra-op threads sleep instead of busy-waiting: a little slower
    for one stream of calls on idle cores, much faster when other threads (decoding) share the cores.
    """
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = intra_op_threads
    options.inter_op_num_threads = inter_op_threads
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.add_session_config_entry("session.intra_op.allow_spinning", "1" if allow_spinning else "0")
    if profile_prefix:
        options.enable_profiling = True
        options.profile_file_prefix = profile_prefix
    return ort.InferenceSession(str(model_path), options, providers=["CPUExecutionProvider"])


def ort_runner(session):
    """`run(batch) -> logits` for a single-input, single-output session."""
    input_name = session.get_inputs()[0].name
    return lambda batch: session.run(None, {input_name: batch})[0]
