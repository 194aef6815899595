// Lanes: independent channels inside one generation of the ft backend.
// (docs/design.md, "Lanes")
//
// Every transport has its own inner communicator per lane, so an op stuck on
// one lane (say, behind a stopped peer) never delays an op issued on another.
// The lane an op runs on is chosen by the calling thread (set_current_lane /
// `ft.lane(k)`), so torch's own collective APIs reach the right lane without
// new arguments. FtBackend::submit() hands the lane's index to the transport
// that serves the tensors' device (see transport.hpp).
#pragma once

namespace ft {

// The lane the calling thread's next op uses (thread-local, default 0).
int currentLane();
void setCurrentLane(int lane);

} // namespace ft
