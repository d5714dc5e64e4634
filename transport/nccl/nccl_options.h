// Options of the NCCL backend (nccl_transport.h). The group layer carries them as
// group::TransportOptions::nccl (PULSELOCO_CUDA_DEVICE, PULSELOCO_LOCAL_RANK, LOCAL_RANK).
#pragma once

namespace pulseloco::transport {

struct NcclOptions {
  int cuda_device = -1;  // -1: the local rank modulo the number of visible devices
  int local_rank = -1;   // the rank among the processes of this host; -1: 0
};

}  // namespace pulseloco::transport
