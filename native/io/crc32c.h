// CRC-32C (Castagnoli, the iSCSI / ext4 / safetensors-tooling polynomial) of a byte buffer.
#pragma once

#include <cstddef>
#include <cstdint>

namespace nvo {

// CRC-32C of `nbytes` bytes at `data`, continuing from `crc` (0 to start): crc32c(b, crc32c(a)) is the CRC
// of a followed by b. Uses SSE4.2's crc32 instruction on three interleaved streams where the CPU has it,
// else a slicing-by-8 table; both give the same value.
uint32_t crc32c(const void* data, size_t nbytes, uint32_t crc);

// The CRC-32C of a followed by b, from crc32c(a), crc32c(b) and b's length: the I/O threads checksum their
// blocks in parallel and a tensor's CRC is joined from its blocks' (O(log len2), no data touched).
uint32_t crc32c_combine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b);

// The table version alone (for tests, and the speed of hosts without SSE4.2).
uint32_t crc32c_software(const void* data, size_t nbytes, uint32_t crc);

}  // namespace nvo
