import io

import pytest

from mnv3.progress import progress_bar

pytestmark = pytest.mark.unit


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_a_bar_is_drawn_on_a_terminal_and_cleared_when_done():
    terminal = Terminal()
    assert list(progress_bar(range(3), "calibration", file=terminal)) == [0, 1, 2]
    drawn = terminal.getvalue()
    assert drawn.startswith("\rcalibration:")
    *_, last_drawn, after = drawn.split("\r")
    assert last_drawn.strip() == "" and after == ""  # leave=False: wiped, not left above the next print


def test_no_bar_in_a_file_or_pipe_or_without_a_label():
    log, terminal = io.StringIO(), Terminal()
    assert list(progress_bar(range(3), "calibration", file=log)) == [0, 1, 2]
    with progress_bar(total=3, desc=None, file=terminal) as bar:
        bar.update(3)
    assert log.getvalue() == "" and terminal.getvalue() == ""
