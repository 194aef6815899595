// A gRPC ByteBuffer's bytes as one contiguous string, for code that parses
// them (the native server's requests and call-stream messages, the native
// client's call-stream answers).
//
// Contract: readByteBuffer replaces `*out` with every byte of `buffer`, in
// order, and returns true; where gRPC cannot dump the buffer's slices it
// leaves `*out` empty and returns false, and the caller answers that as a
// malformed message (never as an empty one).
#pragma once

#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/slice.h>

#include <cstddef>
#include <string>
#include <vector>

namespace ft_grpc {

inline bool readByteBuffer(const grpc::ByteBuffer& buffer, std::string* out) {
  out->clear();
  std::vector<grpc::Slice> slices;
  if (!buffer.Dump(&slices).ok())
    return false;
  size_t size = 0;
  for (const auto& s : slices)
    size += s.size();
  out->reserve(size);
  for (const auto& s : slices)
    out->append(reinterpret_cast<const char*>(s.begin()), s.size());
  return true;
}

} // namespace ft_grpc
