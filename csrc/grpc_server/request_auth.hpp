// Request signatures of ft's control plane, in C++: the native server checks
// them (RequestVerifier) and the native client makes them (RequestSigner).
// ft.utils.auth is the specification; tests/security/test_native_verifier.py
// holds both sides to it.
//
// Contract:
// - A token is "v2.<unix ms>.<32 hex nonce>.<32 hex server id>.<hex
//   HMAC-SHA256>", the HMAC taken with the purpose's key over
//   "v2\n<method>\n<server id>\n<ms>\n<nonce>\n" followed by the request
//   bytes. The server id names one life of one server (drawn at random when it
//   starts): a verifier accepts only tokens made for its own id, so a request
//   captured on its way to one server is refused by every other server and by
//   the same one after a restart (docs/security.md, "Bound to one server").
// - kServerIdMethod is the one method that is not signed (it tells a client
//   the server id to sign for; Python answers it).
// - A signed request carries its token in a leading protobuf field
//   (kAuthFieldNumber, length-delimited) ahead of the request's own fields:
//   servers that do not know it (torchft's) skip it as an unknown field, and
//   ft's servers take it off before anything parses the request. The token
//   covers the bytes after that field. Why a field and not gRPC metadata: a
//   header whose value changes on every request cannot be indexed by HPACK,
//   and carrying it cost more than signing (docs/security.md).
// - RequestVerifier accepts a token within `skewMs` of this host's clock, and
//   once (nonces are remembered for the skew window, at most `maxNonces`; past
//   that the oldest are forgotten and anything as old is refused).
//   Thread-safe. verify() returns "" when the token is good, else the reason
//   (never the key).
// - RequestSigner makes tokens whose nonces do not repeat: a random 64-bit
//   prefix per signer and a counter, for the server id last set
//   (setServerId). Thread-safe. Not fork-safe, as the gRPC
//   channel that holds it is not: a child must make its own channel.
// - splitSigned and ft.utils.auth.split_signed agree on every input (a
//   randomized test holds them to it).
#pragma once

#include <openssl/crypto.h>
#include <openssl/evp.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <random>
#include <stdexcept>
#include <string>
#include <string_view>
#include <unordered_set>
#include <utility>

namespace ft_auth {

// The request field that carries the token (ft.utils.auth.AUTH_FIELD_NUMBER).
// No torchft message uses field numbers this high.
constexpr uint32_t kAuthFieldNumber = 8001;
// Its key byte(s) on the wire: (8001 << 3) | 2 (length-delimited), a varint.
constexpr unsigned char kAuthTag[3] = {0x8A, 0xF4, 0x03};
static_assert(
    kAuthTag[0] == (((kAuthFieldNumber << 3) | 2) & 0x7F | 0x80) &&
        kAuthTag[1] == ((((kAuthFieldNumber << 3) | 2) >> 7) & 0x7F | 0x80) &&
        kAuthTag[2] == (((kAuthFieldNumber << 3) | 2) >> 14),
    "kAuthTag must be the varint key of field kAuthFieldNumber, wire type 2");
// Tokens are ~150 bytes; anything longer than this is not one of ours.
constexpr size_t kMaxTokenBytes = 255;
// ft.utils.auth.SERVER_ID_METHOD: not signed, answered by Python.
constexpr const char* kServerIdMethod = "/ft.Auth/ServerId";
// ft.utils.auth.OTHER_SERVER: what a refusal for another server id says.
constexpr const char* kOtherServer = "signed for another server";
constexpr size_t kServerIdChars = 32;

// HMAC-SHA256 keyed once: the hash states after absorbing (key ^ ipad) and
// (key ^ opad) are kept, and each message copies them. That saves re-keying
// and, on OpenSSL 3, the algorithm lookup an HMAC() call makes every time.
class KeyedHmac {
 public:
  explicit KeyedHmac(const std::string& key) {
    const EVP_MD* sha256 = EVP_sha256();
    unsigned char block[64] = {0};
    if (key.size() > sizeof(block)) {
      unsigned int n = 0;
      EVP_Digest(key.data(), key.size(), block, &n, sha256, nullptr);
    } else {
      std::memcpy(block, key.data(), key.size());
    }
    unsigned char ipad[64], opad[64];
    for (size_t i = 0; i < sizeof(block); ++i) {
      ipad[i] = block[i] ^ 0x36;
      opad[i] = block[i] ^ 0x5c;
    }
    inner_ = EVP_MD_CTX_new();
    outer_ = EVP_MD_CTX_new();
    const bool ok = inner_ != nullptr && outer_ != nullptr &&
        EVP_DigestInit_ex(inner_, sha256, nullptr) == 1 &&
        EVP_DigestUpdate(inner_, ipad, sizeof(ipad)) == 1 &&
        EVP_DigestInit_ex(outer_, sha256, nullptr) == 1 &&
        EVP_DigestUpdate(outer_, opad, sizeof(opad)) == 1;
    OPENSSL_cleanse(block, sizeof(block));
    OPENSSL_cleanse(ipad, sizeof(ipad));
    OPENSSL_cleanse(opad, sizeof(opad));
    if (!ok) {
      EVP_MD_CTX_free(inner_);
      EVP_MD_CTX_free(outer_);
      throw std::runtime_error("ft: OpenSSL could not set up HMAC-SHA256");
    }
  }
  ~KeyedHmac() {
    EVP_MD_CTX_free(inner_);
    EVP_MD_CTX_free(outer_);
  }
  KeyedHmac(const KeyedHmac&) = delete;
  KeyedHmac& operator=(const KeyedHmac&) = delete;

  // Lowercase hex HMAC of the concatenated `parts` (pointer, size); "" if
  // OpenSSL failed (matches no token).
  std::string hex(
      std::initializer_list<std::pair<const char*, size_t>> parts) const {
    // One scratch context per thread, reused (on OpenSSL 3.0 each copy still
    // duplicates the provider's digest state: two small allocations per MAC).
    thread_local std::unique_ptr<EVP_MD_CTX, void (*)(EVP_MD_CTX*)> scratch(
        EVP_MD_CTX_new(),
        EVP_MD_CTX_free);
    EVP_MD_CTX* ctx = scratch.get();
    unsigned char inner[EVP_MAX_MD_SIZE], out[EVP_MAX_MD_SIZE];
    unsigned int innerLen = 0, outLen = 0;
    bool ok = ctx != nullptr && EVP_MD_CTX_copy_ex(ctx, inner_) == 1;
    for (const auto& [data, size] : parts)
      ok = ok && EVP_DigestUpdate(ctx, data, size) == 1;
    ok = ok && EVP_DigestFinal_ex(ctx, inner, &innerLen) == 1 &&
        EVP_MD_CTX_copy_ex(ctx, outer_) == 1 &&
        EVP_DigestUpdate(ctx, inner, innerLen) == 1 &&
        EVP_DigestFinal_ex(ctx, out, &outLen) == 1;
    if (!ok)
      return std::string();
    static const char* kHex = "0123456789abcdef";
    std::string hex(outLen * 2, '0');
    for (unsigned int i = 0; i < outLen; ++i) {
      hex[2 * i] = kHex[out[i] >> 4];
      hex[2 * i + 1] = kHex[out[i] & 15];
    }
    return hex;
  }

 private:
  EVP_MD_CTX* inner_ = nullptr; // read-only after construction
  EVP_MD_CTX* outer_ = nullptr;
};

// The HMAC of a request: over "v2\n<what>\n<server id>\n<ms>\n<nonce>\n" +
// body, fed in pieces (no copy of the request).
inline std::string requestMac(
    const KeyedHmac& hmac,
    std::string_view what,
    std::string_view serverId,
    std::string_view ms,
    std::string_view nonce,
    const char* body,
    size_t bodySize) {
  return hmac.hex({
      {"v2\n", 3},
      {what.data(), what.size()},
      {"\n", 1},
      {serverId.data(), serverId.size()},
      {"\n", 1},
      {ms.data(), ms.size()},
      {"\n", 1},
      {nonce.data(), nonce.size()},
      {"\n", 1},
      {body, bodySize},
  });
}

inline int64_t unixMillis() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// The bytes that go ahead of a request to carry `token` (its leading field).
inline std::string signedPrefix(const std::string& token) {
  std::string p(reinterpret_cast<const char*>(kAuthTag), sizeof(kAuthTag));
  size_t n = token.size();
  while (n >= 0x80) {
    p.push_back(static_cast<char>((n & 0x7F) | 0x80));
    n >>= 7;
  }
  p.push_back(static_cast<char>(n));
  p.append(token);
  return p;
}

// When `data` opens with the auth field, returns its token and sets `*offset`
// to where the signed request starts; otherwise returns "" and `*offset` = 0.
// A malformed field (a length that is too long or runs past the end) is
// reported as the token "\x01malformed", which no verifier accepts.
inline std::string splitSigned(const char* data, size_t size, size_t* offset) {
  *offset = 0;
  if (size < sizeof(kAuthTag) ||
      std::memcmp(data, kAuthTag, sizeof(kAuthTag)) != 0)
    return std::string();
  size_t pos = sizeof(kAuthTag), len = 0;
  for (int shift = 0; shift <= 7; shift += 7) {
    if (pos >= size)
      return std::string("\x01malformed");
    const unsigned char b = static_cast<unsigned char>(data[pos++]);
    len |= static_cast<size_t>(b & 0x7F) << shift;
    if ((b & 0x80) == 0) {
      if (len > kMaxTokenBytes || len > size - pos)
        return std::string("\x01malformed");
      for (size_t i = pos; i < pos + len; ++i) {
        if (static_cast<unsigned char>(data[i]) >= 0x80)
          return std::string("\x01malformed"); // tokens are ASCII
      }
      *offset = pos + len;
      return std::string(data + pos, len);
    }
  }
  return std::string("\x01malformed");
}

inline bool isServerId(std::string_view s) {
  return s.size() == kServerIdChars &&
      s.find_first_not_of("0123456789abcdef") == std::string_view::npos;
}

class RequestVerifier {
 public:
  RequestVerifier(
      std::string key,
      int64_t skewMs,
      size_t maxNonces,
      std::string serverId)
      : hmac_(key),
        skewMs_(skewMs),
        maxNonces_(maxNonces),
        serverId_(std::move(serverId)) {
    OPENSSL_cleanse(key.data(), key.size());
    if (!isServerId(serverId_))
      throw std::invalid_argument(
          "server_id must be 32 lowercase hex characters");
  }

  std::string verify(
      const std::string& what,
      const char* body,
      size_t bodySize,
      const std::string& token) {
    if (token.empty())
      return "no signature (the caller has no job secret)";
    for (char c : token) {
      if (static_cast<unsigned char>(c) >= 0x80)
        return "malformed signature"; // as the specification: tokens are ASCII
    }
    // v2 . ms . nonce . server id . mac
    size_t dots[5];
    size_t n = 0;
    for (size_t i = 0; i < token.size() && n < 5; ++i) {
      if (token[i] == '.')
        dots[n++] = i;
    }
    if (n == 3 && token.compare(0, dots[0], "v1") == 0)
      return "signature not bound to a server (the caller runs an older ft; "
             "every process of the job must run the same version)";
    if (n != 4 || token.compare(0, dots[0], "v2") != 0)
      return "malformed signature";
    const std::string_view view(token);
    const std::string_view ms = view.substr(dots[0] + 1, dots[1] - dots[0] - 1);
    const std::string_view nonce =
        view.substr(dots[1] + 1, dots[2] - dots[1] - 1);
    const std::string_view sid =
        view.substr(dots[2] + 1, dots[3] - dots[2] - 1);
    if (ms.empty() || ms.size() > 18 ||
        ms.find_first_not_of("0123456789") != std::string_view::npos ||
        nonce.size() != kNonceChars || !isServerId(sid))
      return "malformed signature";
    const std::string expected =
        requestMac(hmac_, what, sid, ms, nonce, body, bodySize);
    const size_t macSize = token.size() - dots[3] - 1;
    if (expected.empty() || macSize != expected.size() ||
        CRYPTO_memcmp(
            token.data() + dots[3] + 1,
            expected.data(),
            expected.size()) != 0)
      return "bad signature (a different job secret, or an altered request)";
    if (sid != serverId_)
      return std::string(kOtherServer) + " (server id " +
          std::string(sid.substr(0, 8)) + "...), not this one (" +
          serverId_.substr(0, 8) +
          "...): a request captured on its way elsewhere, or sent before this "
          "server restarted";
    int64_t t = 0;
    for (char c : ms)
      t = t * 10 + (c - '0');
    const int64_t now = unixMillis();
    if (std::llabs(now - t) > skewMs_) {
      char buf[160];
      std::snprintf(
          buf,
          sizeof(buf),
          "signature is %.1fs off this host's clock (more than %.0fs: expired, "
          "or clocks disagree)",
          std::llabs(now - t) / 1000.0,
          skewMs_ / 1000.0);
      return buf;
    }
    Nonce key;
    std::memcpy(key.data(), nonce.data(), kNonceChars);
    std::lock_guard<std::mutex> g(mu_);
    prune(now);
    if (seen_.count(key) != 0 || t < forgottenBeforeMs_)
      return "replayed request (this signature was already used)";
    seen_.insert(key);
    order_.emplace_back(t, key);
    return std::string();
  }

 private:
  static constexpr size_t kNonceChars = 32;
  // A nonce as remembered: its 32 characters, held inline (no allocation
  // beyond the set's node).
  using Nonce = std::array<char, kNonceChars>;
  struct NonceHash {
    size_t operator()(const Nonce& n) const {
      return std::hash<std::string_view>()(
          std::string_view(n.data(), n.size()));
    }
  };

  // mu_ held. Forgets nonces older than the window, and the oldest beyond
  // maxNonces_.
  void prune(int64_t now) {
    const int64_t cutoff = now - skewMs_;
    while (!order_.empty() &&
           (order_.front().first < cutoff || order_.size() > maxNonces_)) {
      auto [t, nonce] = std::move(order_.front());
      order_.pop_front();
      seen_.erase(nonce);
      if (t >= cutoff)
        forgottenBeforeMs_ = std::max(forgottenBeforeMs_, t + 1);
    }
  }

  const KeyedHmac hmac_;
  const int64_t skewMs_;
  const size_t maxNonces_;
  const std::string serverId_;
  std::mutex mu_;
  std::unordered_set<Nonce, NonceHash> seen_;
  std::deque<std::pair<int64_t, Nonce>> order_;
  int64_t forgottenBeforeMs_ = 0;
};

class RequestSigner {
 public:
  explicit RequestSigner(std::string key) : hmac_(key) {
    OPENSSL_cleanse(key.data(), key.size());
    std::random_device rd;
    const uint64_t r = (static_cast<uint64_t>(rd()) << 32) ^ rd();
    prefix_ = hex16(r);
  }

  // The server id the next tokens are made for (ft.utils.auth: the client
  // learns it from the server before it signs). Until set: all zeros, which no
  // server that checks signatures has.
  void setServerId(const std::string& serverId) {
    if (!isServerId(serverId))
      throw std::invalid_argument(
          "server_id must be 32 lowercase hex characters");
    std::lock_guard<std::mutex> g(mu_);
    serverId_ = serverId;
  }

  // The token for `body` sent to `what` (a gRPC method path).
  std::string
  token(const std::string& what, const char* body, size_t bodySize) {
    const std::string ms = std::to_string(unixMillis());
    const std::string nonce =
        prefix_ + hex16(counter_.fetch_add(1, std::memory_order_relaxed));
    std::string sid;
    {
      std::lock_guard<std::mutex> g(mu_);
      sid = serverId_;
    }
    std::string t;
    t.reserve(3 + ms.size() + 1 + nonce.size() + 1 + sid.size() + 1 + 64);
    t.append("v2.").append(ms).append(".").append(nonce).append(".");
    t.append(sid).append(".");
    t.append(requestMac(hmac_, what, sid, ms, nonce, body, bodySize));
    return t;
  }

 private:
  static std::string hex16(uint64_t v) {
    static const char* kHex = "0123456789abcdef";
    std::string s(16, '0');
    for (int i = 15; i >= 0; --i, v >>= 4)
      s[i] = kHex[v & 15];
    return s;
  }

  const KeyedHmac hmac_;
  std::string prefix_;
  std::atomic<uint64_t> counter_{0};
  std::mutex mu_;
  std::string serverId_ = std::string(kServerIdChars, '0');
};

} // namespace ft_auth
