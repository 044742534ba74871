// HMAC-SHA256 as Jupyter's wire protocol uses it: the hex digest of the key's
// bytes over the message bytes, compared in constant time.
#pragma once

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>

#include <array>
#include <string>
#include <string_view>

namespace gpucleanup::detail {

// Lowercase hex HMAC-SHA256 of `data` under `key`; "" if libcrypto fails.
inline std::string hmac_sha256_hex(std::string_view key, std::string_view data) {
  std::array<unsigned char, EVP_MAX_MD_SIZE> digest{};
  unsigned int length = 0;
  if (HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()),
           reinterpret_cast<const unsigned char*>(data.data()), data.size(), digest.data(),
           &length) == nullptr) {
    return {};
  }
  static constexpr char kHex[] = "0123456789abcdef";
  std::string hex(2 * length, '0');
  for (unsigned int i = 0; i < length; ++i) {
    hex[2 * i] = kHex[digest[i] >> 4];
    hex[2 * i + 1] = kHex[digest[i] & 0xf];
  }
  return hex;
}

// Whether `given` is the signature of `data` under `key`. The comparison takes
// the same time wherever the first differing byte is.
inline bool hmac_sha256_verify(std::string_view key, std::string_view data, std::string_view given) {
  const std::string expected = hmac_sha256_hex(key, data);
  if (expected.empty() || given.size() != expected.size()) return false;
  return CRYPTO_memcmp(expected.data(), given.data(), expected.size()) == 0;
}

}  // namespace gpucleanup::detail
