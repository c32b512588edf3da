// CRC-32C. The hardware path runs three independent crc32 streams over
// adjacent blocks (the instruction's latency is three times its throughput)
// and joins them by "shifting" a CRC over a block of zeros: a linear map over
// GF(2), applied through four 256-entry tables built once per block length.
#include "crc32c.h"

#include <cstring>

#if defined(__x86_64__)
#include <nmmintrin.h>
#endif

namespace nvo {
namespace {

constexpr uint32_t kPoly = 0x82f63b78;  // CRC-32C, reflected
constexpr size_t kLong = 8192;          // bytes per stream in the long interleaved loop
constexpr size_t kShort = 256;          // ... and in the short one

// Tables of the table-driven CRC: byte[k][b] is the CRC of byte b followed by k zero bytes.
struct SliceTables {
  uint32_t byte[8][256];
  SliceTables() {
    for (uint32_t n = 0; n < 256; ++n) {
      uint32_t crc = n;
      for (int k = 0; k < 8; ++k) crc = crc & 1 ? (crc >> 1) ^ kPoly : crc >> 1;
      byte[0][n] = crc;
    }
    for (uint32_t n = 0; n < 256; ++n) {
      for (int k = 1; k < 8; ++k) byte[k][n] = (byte[k - 1][n] >> 8) ^ byte[0][byte[k - 1][n] & 0xff];
    }
  }
};

const SliceTables& slice_tables() {
  static const SliceTables tables;
  return tables;
}

uint32_t gf2_times(const uint32_t* matrix, uint32_t vector) {
  uint32_t sum = 0;
  for (; vector; vector >>= 1, ++matrix) {
    if (vector & 1) sum ^= *matrix;
  }
  return sum;
}

void gf2_square(uint32_t* square, const uint32_t* matrix) {
  for (int n = 0; n < 32; ++n) square[n] = gf2_times(matrix, matrix[n]);
}

// The operator that appends `nbytes` zero bytes (a power of two) to a raw CRC register, as a table of the
// images of its four bytes.
struct ShiftTables {
  uint32_t byte[4][256];
  explicit ShiftTables(size_t nbytes) {
    uint32_t odd[32], even[32];
    odd[0] = kPoly;  // one zero bit
    for (int n = 1; n < 32; ++n) odd[n] = 1u << (n - 1);
    gf2_square(even, odd);  // two zero bits
    gf2_square(odd, even);  // four
    const uint32_t* op = even;
    for (;;) {  // each square doubles the count of zero bits: 8, 16, ... in `even`, then `odd`, ...
      gf2_square(even, odd);
      op = even;
      nbytes >>= 1;
      if (nbytes == 0) break;
      gf2_square(odd, even);
      op = odd;
      nbytes >>= 1;
      if (nbytes == 0) break;
    }
    for (uint32_t n = 0; n < 256; ++n) {
      for (int k = 0; k < 4; ++k) byte[k][n] = gf2_times(op, n << (8 * k));
    }
  }
  uint32_t shift(uint32_t crc) const {
    return byte[0][crc & 0xff] ^ byte[1][(crc >> 8) & 0xff] ^ byte[2][(crc >> 16) & 0xff] ^ byte[3][crc >> 24];
  }
};

#if defined(__x86_64__)
inline uint64_t load64(const unsigned char* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}

// Three streams over adjacent `block`-byte parts while 3 * block bytes are left; advances `next` and `len`.
__attribute__((target("sse4.2"))) uint64_t interleaved(uint64_t crc0, const unsigned char*& next, size_t& len,
                                                       size_t block, const ShiftTables& shift) {
  while (len >= 3 * block) {
    uint64_t crc1 = 0, crc2 = 0;
    for (const unsigned char* end = next + block; next < end; next += 8) {
      crc0 = _mm_crc32_u64(crc0, load64(next));
      crc1 = _mm_crc32_u64(crc1, load64(next + block));
      crc2 = _mm_crc32_u64(crc2, load64(next + 2 * block));
    }
    crc0 = shift.shift(static_cast<uint32_t>(crc0)) ^ crc1;
    crc0 = shift.shift(static_cast<uint32_t>(crc0)) ^ crc2;
    next += 2 * block;
    len -= 3 * block;
  }
  return crc0;
}

__attribute__((target("sse4.2"))) uint32_t crc32c_sse42(const unsigned char* next, size_t len, uint32_t crc) {
  static const ShiftTables long_shift(kLong), short_shift(kShort);
  uint64_t crc0 = crc ^ 0xffffffffu;
  for (; len && (reinterpret_cast<uintptr_t>(next) & 7); --len) crc0 = _mm_crc32_u8(static_cast<uint32_t>(crc0), *next++);
  crc0 = interleaved(crc0, next, len, kLong, long_shift);
  crc0 = interleaved(crc0, next, len, kShort, short_shift);
  for (; len >= 8; len -= 8, next += 8) crc0 = _mm_crc32_u64(crc0, load64(next));
  for (; len; --len) crc0 = _mm_crc32_u8(static_cast<uint32_t>(crc0), *next++);
  return static_cast<uint32_t>(crc0) ^ 0xffffffffu;
}

bool has_sse42() {
  static const bool has = __builtin_cpu_supports("sse4.2");
  return has;
}
#endif

}  // namespace

uint32_t crc32c_software(const void* data, size_t nbytes, uint32_t crc) {
  const SliceTables& t = slice_tables();
  const auto* next = static_cast<const unsigned char*>(data);
  uint32_t c = crc ^ 0xffffffffu;
  for (; nbytes >= 8; nbytes -= 8, next += 8) {  // slicing by 8 (little-endian hosts)
    uint32_t lo, hi;
    std::memcpy(&lo, next, 4);
    std::memcpy(&hi, next + 4, 4);
    lo ^= c;
    c = t.byte[7][lo & 0xff] ^ t.byte[6][(lo >> 8) & 0xff] ^ t.byte[5][(lo >> 16) & 0xff] ^ t.byte[4][lo >> 24] ^
        t.byte[3][hi & 0xff] ^ t.byte[2][(hi >> 8) & 0xff] ^ t.byte[1][(hi >> 16) & 0xff] ^ t.byte[0][hi >> 24];
  }
  for (; nbytes; --nbytes) c = (c >> 8) ^ t.byte[0][(c ^ *next++) & 0xff];
  return c ^ 0xffffffffu;
}

namespace {

// a * b modulo the polynomial, both reflected (bit 31 is x^0).
uint32_t multiply_mod_poly(uint32_t a, uint32_t b) {
  uint32_t product = 0;
  for (uint32_t m = 1u << 31; m; m >>= 1) {
    if (a & m) {
      product ^= b;
      if ((a & (m - 1)) == 0) break;
    }
    b = b & 1 ? (b >> 1) ^ kPoly : b >> 1;
  }
  return product;
}

// x^(2^k) modulo the polynomial, for k = 0..63.
struct PowerTable {
  uint32_t x2k[64];
  PowerTable() {
    uint32_t p = 1u << 30;  // x^1
    for (auto& entry : x2k) {
      entry = p;
      p = multiply_mod_poly(p, p);
    }
  }
};

}  // namespace

uint32_t crc32c_combine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b) {
  static const PowerTable powers;
  uint32_t shift = 1u << 31;  // x^0; becomes x^(8 * len_b): appending len_b bytes multiplies by it
  for (unsigned k = 3; len_b; len_b >>= 1, ++k) {
    if (len_b & 1) shift = multiply_mod_poly(powers.x2k[k & 63], shift);
  }
  return multiply_mod_poly(shift, crc_a) ^ crc_b;
}

uint32_t crc32c(const void* data, size_t nbytes, uint32_t crc) {
#if defined(__x86_64__)
  if (has_sse42()) return crc32c_sse42(static_cast<const unsigned char*>(data), nbytes, crc);
#endif
  return crc32c_software(data, nbytes, crc);
}

}  // namespace nvo
