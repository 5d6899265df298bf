"""checkpoint/writer.py's crc32_off: DCP's records written without torch.save's CRC32 (half of a
save's time; torch.load never checks it), torch's option put back after, and never taken from
another thread (torch 2.13 keeps the option per thread; 2.11, the suite's floor, for the whole
process, where crc32_off leaves it on). A real save and load across ranks is
tests/test_checkpoint.py's."""

from __future__ import annotations

import io
import threading
import zipfile

import pytest
import torch
from torch.serialization import get_crc32_options, set_crc32_options

from elastic_nb.checkpoint.writer import _crc32_is_per_thread, crc32_off

pytestmark = pytest.mark.unit


def _crcs(t: torch.Tensor) -> tuple[list[int], torch.Tensor]:
    buf = io.BytesIO()
    torch.save(t, buf)
    records = zipfile.ZipFile(io.BytesIO(buf.getvalue())).infolist()
    crcs = [r.CRC for r in records if "/data/" in r.filename]
    return crcs, torch.load(io.BytesIO(buf.getvalue()))


def _per_thread_by_hand() -> bool:
    """The same question as the product's probe, asked the other way round: this thread flips
    the option, another thread reads it."""
    seen: list[bool] = []
    set_crc32_options(False)
    try:
        thread = threading.Thread(target=lambda: seen.append(get_crc32_options()))
        thread.start()
        thread.join(30)
    finally:
        set_crc32_options(True)
    return seen == [True]


def test_the_probe_reads_torch_as_it_is() -> None:
    assert _crc32_is_per_thread() == _per_thread_by_hand()
    assert get_crc32_options()  # the probe put it back


def test_records_written_inside_carry_no_crc_where_the_option_is_the_threads_own() -> None:
    t = torch.randn(1000)
    assert get_crc32_options()
    with crc32_off():
        crcs, back = _crcs(t)
    assert torch.equal(back, t)
    if _per_thread_by_hand():
        assert crcs == [0]
    else:  # the whole process's option: left on, for a user's torch.save in another thread
        assert crcs != [0]
    assert get_crc32_options()  # put back
    crcs, _ = _crcs(t)
    assert crcs != [0]


def test_another_threads_save_keeps_its_crc32() -> None:
    seen: list[bool] = []
    with crc32_off():
        thread = threading.Thread(target=lambda: seen.append(_crcs(torch.ones(3))[0] != [0]))
        thread.start()
        thread.join(30)
    assert seen == [True]


def test_a_user_who_turned_it_off_keeps_it_off() -> None:
    set_crc32_options(False)
    try:
        with crc32_off():
            pass
        assert not get_crc32_options()
    finally:
        set_crc32_options(True)
