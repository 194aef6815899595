// Host staging: how a CUDA op runs when NCCL cannot carry it, because two
// ranks of one communicator sit on the same physical GPU (NCCL refuses such
// a communicator). The op then runs on the lane's Gloo communicator over
// host copies of its tensors (docs/design.md, "Shared GPUs").
//
// Contract:
//  * sharedDevices(ids) is the decision, pure: given each rank's device id
//    (its GPU's UUID, as every rank published it through the store), the
//    groups of ranks (two or more, ascending) that share one. Every rank reads
//    the same ids, so every rank decides alike: empty means NCCL can carry
//    the communicator; anything else means none can be made.
//  * HostStaging::stage(t) returns a host copy of CUDA tensor `t` (pinned
//    memory, copied after the work queued on the caller's current stream);
//    every other tensor is returned as is, unless staging is forced (the CPU
//    tests of this path: then CPU tensors are copied to fresh CPU tensors).
//    The same tensor staged twice yields the same copy.
//  * copyBack(outputs) copies each staged host copy back into its original
//    when that original is one of `outputs` (the tensors the op writes), and
//    returns once the copies are done. The backend calls it on success only,
//    before the op's own finalize, so nothing lands in a caller's tensor after
//    a failed or aborted op.
//  * stageArgs() maps an op's arguments (tensors, tensor lists, lists of
//    lists; options and scalars pass through) through stage().
#pragma once

#include <ATen/ATen.h>

#include <string>
#include <utility>
#include <vector>

namespace ft {

std::vector<std::vector<int>> sharedDevices(
    const std::vector<std::string>& ids);

class HostStaging {
 public:
  explicit HostStaging(bool forceCpuCopies = false)
      : forceCpuCopies_(forceCpuCopies) {}

  at::Tensor stage(const at::Tensor& t);
  void copyBack(const std::vector<at::Tensor>& outputs) const;

  at::Tensor stageArg(const at::Tensor& t) {
    return stage(t);
  }
  std::vector<at::Tensor> stageArg(const std::vector<at::Tensor>& ts) {
    std::vector<at::Tensor> out;
    out.reserve(ts.size());
    for (const auto& t : ts) {
      out.push_back(stage(t));
    }
    return out;
  }
  std::vector<std::vector<at::Tensor>> stageArg(
      const std::vector<std::vector<at::Tensor>>& lists) {
    std::vector<std::vector<at::Tensor>> out;
    out.reserve(lists.size());
    for (const auto& list : lists) {
      out.push_back(stageArg(list));
    }
    return out;
  }
  template <typename T>
  T stageArg(const T& other) {
    return other; // options, ranks, tags, split sizes
  }

 private:
  bool staged(const at::Tensor& t) const {
    return t.is_cuda() || (forceCpuCopies_ && t.device().is_cpu());
  }
  const bool forceCpuCopies_;
  // (original, host copy) for every tensor staged.
  std::vector<std::pair<at::Tensor, at::Tensor>> copies_;
};

} // namespace ft
