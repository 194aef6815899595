// The one place that chooses transports (see transport.hpp): what an NCCL
// build adds is decided in the #ifdef below and nowhere else.
#include "transport.hpp"

#include <c10/util/Exception.h>

#include "gloo_comm.hpp"

#ifdef FT_USE_NCCL
#include "nccl_comm.hpp"
#endif

namespace ft {

namespace {

#ifdef FT_USE_NCCL
constexpr bool kHasCudaTransport = true;
// Its communicators are created by configure() (eager) or on each lane's
// first CUDA op. Nothing here touches CUDA.
std::shared_ptr<Transport> makeCudaTransport(const TransportSpec& spec) {
  return makeNcclTransport(spec);
}
#else
constexpr bool kHasCudaTransport = false;
std::shared_ptr<Transport> makeCudaTransport(const TransportSpec& /*spec*/) {
  return nullptr;
}
#endif

} // namespace

Transports makeTransports(const TransportSpec& spec) {
  Transports transports{connectGloo(spec)};
  // spec.timeout does not apply: a CUDA transport waits against each op's own
  // deadline.
  if (auto cuda = makeCudaTransport(spec)) {
    transports.push_back(std::move(cuda));
  }
  return transports;
}

void checkTensorDevice(const at::Tensor& t, const char* op) {
  if (t.is_cuda()) {
    TORCH_CHECK_VALUE(
        kHasCudaTransport,
        "ft: ",
        op,
        ": got a CUDA tensor, but this build of ft has no NCCL path "
        "(it was built against a CPU-only torch)");
    return; // the NCCL lane checks dtype and device
  }
  TORCH_CHECK_VALUE(
      t.device().is_cpu(),
      "ft: ",
      op,
      ": unsupported device ",
      t.device(),
      " (supported: cpu, and cuda in an NCCL build)");
}

void checkCudaDeviceSupported(int device) {
  TORCH_CHECK_VALUE(
      kHasCudaTransport || device == -1,
      "ft: this build of ft has no NCCL path (built against a CPU-only torch)");
}

} // namespace ft
