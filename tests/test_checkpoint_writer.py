"""checkpoint/writer.py's crc32_off: DCP's records written without torch.save's CRC32 (half of a
save's time; torch.load never checks it), torch's option (the thread's own) put back after. A
real save and load across ranks is tests/test_checkpoint.py's."""

from __future__ import annotations

import io
import threading
import zipfile

import pytest
import torch
from torch.serialization import get_crc32_options

from elastic_nb.checkpoint.writer import crc32_off

pytestmark = pytest.mark.unit


def _crcs(t: torch.Tensor) -> tuple[list[int], torch.Tensor]:
    buf = io.BytesIO()
    torch.save(t, buf)
    records = zipfile.ZipFile(io.BytesIO(buf.getvalue())).infolist()
    crcs = [r.CRC for r in records if "/data/" in r.filename]
    return crcs, torch.load(io.BytesIO(buf.getvalue()))


def test_records_written_inside_carry_no_crc_and_load_the_same() -> None:
    t = torch.randn(1000)
    assert get_crc32_options()
    with crc32_off():
        crcs, back = _crcs(t)
    assert crcs == [0] and torch.equal(back, t)
    assert get_crc32_options()  # put back
    crcs, _ = _crcs(t)
    assert crcs != [0]


def test_the_option_is_the_threads_own() -> None:
    """torch keeps it per thread: another thread's torch.save meanwhile keeps its CRC32."""
    seen: list[bool] = []
    with crc32_off():
        thread = threading.Thread(target=lambda: seen.append(_crcs(torch.ones(3))[0] != [0]))
        thread.start()
        thread.join(30)
    assert seen == [True]


def test_a_user_who_turned_it_off_keeps_it_off() -> None:
    from torch.serialization import set_crc32_options

    set_crc32_options(False)
    try:
        with crc32_off():
            pass
        assert not get_crc32_options()
    finally:
        set_crc32_options(True)
