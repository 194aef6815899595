// The c10d::Backend collectives ft implements, each signature written once.
//
// FtBackend (backend.hpp) overrides every op below; an NcclLane
// (nccl_comm.hpp) the lane ops only (the others, on CUDA tensors, reach
// c10d::Backend's defaults there). Both classes declare their overrides from
// these lists, so each signature is spelled once, as c10d's Backend.hpp
// spells it. FtBackend's adapters are defined with FT_C10D_DEFINE and use the
// parameter names given here; NcclLane's definitions spell theirs out
// (leaving the parameters they ignore unnamed).
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <cstdint>
#include <vector>

// The parameter list of c10d::Backend::<op>, with names.
#define FT_C10D_PARAMS(op) FT_C10D_PARAMS_##op

// One op a line (too long for the layout tool, which would split them).
// clang-format off
#define FT_C10D_PARAMS_broadcast (std::vector<at::Tensor>& tensors, const c10d::BroadcastOptions& opts)
#define FT_C10D_PARAMS_allreduce (std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts)
#define FT_C10D_PARAMS_allreduce_coalesced (std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts)
#define FT_C10D_PARAMS_reduce (std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts)
#define FT_C10D_PARAMS_allgather (std::vector<std::vector<at::Tensor>>& outputTensors, std::vector<at::Tensor>& inputTensors, const c10d::AllgatherOptions& opts)
#define FT_C10D_PARAMS__allgather_base (at::Tensor& outputBuffer, at::Tensor& inputBuffer, const c10d::AllgatherOptions& opts)
#define FT_C10D_PARAMS_allgather_coalesced (std::vector<std::vector<at::Tensor>>& outputTensors, std::vector<at::Tensor>& inputTensors, const c10d::AllgatherOptions& opts)
#define FT_C10D_PARAMS_allgather_into_tensor_coalesced (std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs, const c10d::AllgatherOptions& opts)
#define FT_C10D_PARAMS_gather (std::vector<std::vector<at::Tensor>>& outputTensors, std::vector<at::Tensor>& inputTensors, const c10d::GatherOptions& opts)
#define FT_C10D_PARAMS_scatter (std::vector<at::Tensor>& outputTensors, std::vector<std::vector<at::Tensor>>& inputTensors, const c10d::ScatterOptions& opts)
#define FT_C10D_PARAMS_reduce_scatter (std::vector<at::Tensor>& outputTensors, std::vector<std::vector<at::Tensor>>& inputTensors, const c10d::ReduceScatterOptions& opts)
#define FT_C10D_PARAMS__reduce_scatter_base (at::Tensor& outputBuffer, at::Tensor& inputBuffer, const c10d::ReduceScatterOptions& opts)
#define FT_C10D_PARAMS_reduce_scatter_tensor_coalesced (std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs, const c10d::ReduceScatterOptions& opts)
#define FT_C10D_PARAMS_alltoall_base (at::Tensor& outputBuffer, at::Tensor& inputBuffer, std::vector<int64_t>& outputSplitSizes, std::vector<int64_t>& inputSplitSizes, const c10d::AllToAllOptions& opts)
#define FT_C10D_PARAMS_alltoall (std::vector<at::Tensor>& outputTensors, std::vector<at::Tensor>& inputTensors, const c10d::AllToAllOptions& opts)
#define FT_C10D_PARAMS_send (std::vector<at::Tensor>& tensors, int dstRank, int tag)
#define FT_C10D_PARAMS_recv (std::vector<at::Tensor>& tensors, int srcRank, int tag)
#define FT_C10D_PARAMS_recvAnysource (std::vector<at::Tensor>& tensors, int tag)
#define FT_C10D_PARAMS_barrier (const c10d::BarrierOptions& opts)
// clang-format on

// The ops an NcclLane runs itself.
#define FT_C10D_LANE_OPS(X)          \
  X(broadcast)                       \
  X(allreduce)                       \
  X(allreduce_coalesced)             \
  X(reduce)                          \
  X(allgather)                       \
  X(_allgather_base)                 \
  X(allgather_into_tensor_coalesced) \
  X(reduce_scatter)                  \
  X(_reduce_scatter_base)            \
  X(reduce_scatter_tensor_coalesced) \
  X(alltoall_base)                   \
  X(send)                            \
  X(recv)                            \
  X(barrier)

// The rest of FtBackend's ops.
#define FT_C10D_BACKEND_ONLY_OPS(X) \
  X(allgather_coalesced)            \
  X(gather)                         \
  X(scatter)                        \
  X(alltoall)                       \
  X(recvAnysource)

// In a class body: `FT_C10D_LANE_OPS(FT_C10D_OVERRIDE)` declares those ops.
#define FT_C10D_OVERRIDE(op) \
  c10::intrusive_ptr<c10d::Work> op FT_C10D_PARAMS(op) override;

// Out of the class: `FT_C10D_DEFINE(FtBackend, broadcast) { ... }` defines
// FtBackend::broadcast, its parameters named as FT_C10D_PARAMS(broadcast) says.
#define FT_C10D_DEFINE(cls, op) \
  c10::intrusive_ptr<c10d::Work> cls::op FT_C10D_PARAMS(op)
