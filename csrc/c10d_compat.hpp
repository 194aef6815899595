#pragma once

// Differences between the c10d headers of the torch versions ft supports
// (2.11 to 2.14) that the preprocessor cannot see. Version checks that it
// can see live in setup.py / CMakeLists.txt as macros
// (C10D_BACKEND_HAS_RECONFIGURE).

#include <torch/csrc/distributed/c10d/Work.hpp>

namespace ft {

namespace detail {
// A template, so that the enumerator missing from older headers is only named
// in a discarded branch.
template <typename OpTypeT>
constexpr OpTypeT reduceScatterTensorCoalescedOpType() {
  if constexpr (requires { OpTypeT::REDUCE_SCATTER_TENSOR_COALESCED; }) {
    return OpTypeT::REDUCE_SCATTER_TENSOR_COALESCED;
  } else {
    return OpTypeT::_REDUCE_SCATTER_BASE;
  }
}
} // namespace detail

// c10d::OpType gained REDUCE_SCATTER_TENSOR_COALESCED after torch 2.11; older
// headers label that op as the single-tensor reduce-scatter it is built from.
inline constexpr c10d::OpType kReduceScatterTensorCoalesced =
    detail::reduceScatterTensorCoalescedOpType<c10d::OpType>();

} // namespace ft
