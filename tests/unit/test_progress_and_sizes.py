import io

import pytest

from ipcpool.progress import Progress
from ipcpool.sizes import format_size, parse_size


def test_plain_lines_off_a_terminal():
    out = io.StringIO()
    with Progress("copying", 3 << 20, unit="B", stream=out, interval=0) as bar:
        for _ in range(3):
            bar.update(1 << 20)
    lines = out.getvalue().splitlines()
    assert lines[:2] == ["copying: 1.0 MiB of 3.0 MiB (33%)", "copying: 2.0 MiB of 3.0 MiB (66%)"]
    assert lines[2].startswith("copying: 3.0 MiB of 3.0 MiB in ") and lines[2].endswith("/s)")
    assert len(lines) == 3 and "\r" not in out.getvalue()


def test_counts_without_a_unit_and_a_quiet_interval():
    out = io.StringIO()
    with Progress("round trips", 1000, stream=out) as bar:   # default interval: no line mid-way here
        bar.update(1000)
    (line,) = out.getvalue().splitlines()
    assert line.startswith("round trips: 1,000 of 1,000 in ") and line.endswith(" steps/s)")


@pytest.mark.parametrize("text,expected", [("0", 0), ("4096", 4096), ("1G", 1 << 30), ("1g", 1 << 30),
                                           ("512M", 512 << 20), ("8GiB", 8 << 30), ("1.5K", 1536),
                                           ("2 TB", 2 << 40), (7, 7)])
def test_sizes_parse(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["lots", "-1", "", "1X", -5, True, "nan", "inf"])
def test_bad_sizes_are_refused(bad):
    with pytest.raises(ValueError, match="size"):
        parse_size(bad)


def test_sizes_format():
    assert [format_size(n) for n in (0, 512, 1536, 8 << 20, 3 << 40)] == ["0 B", "512 B", "1.5 KiB", "8.0 MiB", "3.0 TiB"]
