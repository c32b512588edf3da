"""CRC-32C: the native hardware path (three interleaved streams) equals the table path and a bitwise reference."""

import pytest
import torch

from nvoffload.io import _aio
from nvoffload.io.checksum import crc32c


def _reference(data: bytes, crc: int = 0) -> int:
    """CRC-32C bit by bit (RFC 3720's definition)."""
    crc ^= 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def _software(t: torch.Tensor, crc: int = 0) -> int:
    return _aio.crc32c(t.data_ptr(), t.numel() * t.element_size(), crc, False)


def test_known_values():
    assert crc32c(torch.frombuffer(bytearray(b"123456789"), dtype=torch.uint8)) == 0xE3069283
    assert crc32c(torch.zeros(32, dtype=torch.uint8)) == 0x8A9136AA  # RFC 3720, B.4: 32 bytes of zeros
    assert crc32c(torch.full((32,), 0xFF, dtype=torch.uint8)) == 0x62A8AB43
    assert crc32c(torch.empty(0, dtype=torch.uint8)) == 0


@pytest.mark.parametrize("length", [1, 7, 8, 9, 255, 768, 769, 3 * 8192 - 1, 3 * 8192, 3 * 8192 + 777, 100_003])
@pytest.mark.parametrize("start", [0, 1, 3])
def test_hardware_equals_table_and_reference(length, start):
    g = torch.Generator().manual_seed(length + start)
    data = torch.randint(0, 256, (length + start,), dtype=torch.uint8, generator=g)[start:]
    expected = _software(data)
    assert crc32c(data) == expected
    if length <= 1000:
        assert expected == _reference(data.numpy().tobytes())


def test_continues_across_pieces_and_dtypes():
    data = torch.randn(50_000)  # float32, 200 KB
    whole = crc32c(data)
    assert crc32c(data[30_001:], crc32c(data[:30_001])) == whole
    assert crc32c(data.view(torch.uint8)) == whole
    flipped = data.clone()
    flipped.view(torch.uint8)[123_457] ^= 0x10
    assert crc32c(flipped) != whole


def test_refuses_a_strided_tensor():
    with pytest.raises(ValueError, match="contiguous CPU tensor"):
        crc32c(torch.zeros(4, 4)[:, 0])


@pytest.mark.parametrize("len_a,len_b", [(0, 0), (1, 0), (0, 9), (4096, 1), (1 << 20, 12345), (77, (1 << 16) + 3)])
def test_combine_joins_the_crcs_of_two_parts(len_a, len_b):
    """crc32c_combine(crc(a), crc(b), len(b)) == crc(a + b): how a tensor's CRC is joined from its blocks'."""
    data = torch.randint(0, 256, (len_a + len_b,), generator=torch.Generator().manual_seed(len_a + len_b), dtype=torch.uint8)
    a, b = data[:len_a], data[len_a:]
    assert _aio.crc32c_combine(crc32c(a), crc32c(b), len_b) == crc32c(data)
