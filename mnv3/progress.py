"""Progress bars for the stages' long loops: drawn on a terminal and cleared when done.

Written to a file or a pipe (`make bench > log`, CI), a bar would leave every redraw, joined by carriage
returns, in the middle of the next printed line, so there it is not drawn at all (tqdm's `disable=None`)."""

from tqdm import tqdm


def progress_bar(iterable=None, desc: str | None = None, **kwargs) -> tqdm:
    """tqdm over `iterable` (or `total=`) labelled `desc`; no bar without a `desc` or off a terminal."""
    return tqdm(iterable, desc=desc, leave=False, disable=True if desc is None else None, **kwargs)
