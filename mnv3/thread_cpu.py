"""Where a process's CPU goes: its CPU seconds so far, split by what its threads do.

`cpu_seconds_by_role(roles)` reads every live Python thread's own CPU clock, from any thread, at any time,
and sums them by role: a thread listed in `roles` (by `threading.get_ident()`) has the role given there,
one named with a prefix of THREAD_PREFIXES has that prefix's role (the decode pools of the server and the
in-process limit, and the batchers' inference threads, are named so), and everything else, the engine's
own worker threads (OpenVINO's streams, onnxruntime's intra-op pool), which are not Python threads, and
threads that have exited, is ENGINE_AND_OTHER: the process's CPU time less what the roles add up to.

Guarantees: the roles add up to the process's CPU time (`time.process_time()`) read at the same moment;
a role's seconds only grow while its threads live (ENGINE_AND_OTHER also gets a thread's seconds when it
exits, so the total never goes back). Where the platform has no per-thread CPU clocks
(`time.pthread_getcpuclockid`: Linux and most Unixes have them), everything is ENGINE_AND_OTHER.
"""

import threading
import time

EVENT_LOOP = "event_loop"  # HTTP: parsing, routing, reading uploads, cache lookups, answering
PREPROCESS = "preprocess"  # decode + preprocess
INFERENCE = "inference"  # gathering batches, the calls into the engine (onnxruntime computes on the caller too)
ENGINE_AND_OTHER = "engine_and_other"
ROLES = (EVENT_LOOP, PREPROCESS, INFERENCE, ENGINE_AND_OTHER)
# Thread-name prefixes (a pool's thread_name_prefix, a thread's name) and the role of a thread so named.
PREPROCESS_THREADS = "mnv3-preprocess"
INFERENCE_THREADS = "mnv3-inference"
THREAD_PREFIXES = {PREPROCESS_THREADS: PREPROCESS, INFERENCE_THREADS: INFERENCE}


def cpu_seconds_by_role(roles: dict[int, str] | None = None) -> dict[str, float]:
    """{role: CPU seconds so far} for every one of ROLES, this process's threads grouped as the module
    docstring says; `roles` names threads by ident that no name prefix covers (e.g. the event loop's)."""
    roles = roles or {}
    seconds = dict.fromkeys(ROLES, 0.0)
    if hasattr(time, "pthread_getcpuclockid"):
        for thread in threading.enumerate():
            if thread.ident is None:  # not started
                continue
            role = roles.get(thread.ident) or _role_by_name(thread.name)
            if role is None:  # only threads with a role are read: they live as long as their pool or batcher,
                continue  # and reading an exited thread's clock is what pthread_getcpuclockid warns of
            try:
                seconds[role] += time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
            except OSError:  # it exited after enumerate(): its seconds stay in the process's total
                continue
    # Last: the process's clock then holds at least what every thread's read before it did (an exited
    # thread's seconds stay in it); max() only absorbs the clocks' rounding.
    total = time.process_time()
    seconds[ENGINE_AND_OTHER] = max(0.0, total - sum(seconds.values()))
    return seconds


def _role_by_name(name: str) -> str | None:
    return next((role for prefix, role in THREAD_PREFIXES.items() if name.startswith(prefix)), None)
