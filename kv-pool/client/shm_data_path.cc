#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "kv-pool/client/data_path.h"
#include "kv-pool/client/fd_passing.h"

namespace dd::kvpool {
namespace {

class ShmDataPath : public DataPath {
 public:
  ShmDataPath(uint8_t* base, int64_t bytes) : base_(base), bytes_(bytes) {}
  ~ShmDataPath() override { munmap(base_, bytes_); }
  absl::Status Put(int64_t offset, const void* src, int64_t bytes) override {
    std::memcpy(base_ + offset, src, bytes);
    return absl::OkStatus();
  }
  absl::Status Get(absl::Span<const int64_t> offsets, int64_t block_bytes, absl::Span<void* const> dsts,
                   bool cuda) override {
    if (cuda) return absl::InternalError("kv pool shm: gathers into CUDA memory go through the device");
    for (size_t i = 0; i < offsets.size(); ++i) {
      std::memcpy(dsts[i], base_ + offsets[i], block_bytes);
    }
    return absl::OkStatus();
  }
  const uint8_t* Mapped(int64_t offset) const override { return base_ + offset; }
  int64_t mapped_bytes() const override { return bytes_; }

 private:
  uint8_t* base_;
  int64_t bytes_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<DataPath>> NewShmDataPath(const v1::HandshakeResponse& hs, const std::string& token) {
  if (hs.fd_socket().empty()) {
    return absl::FailedPreconditionError("the kv pool offers no region socket (an older pool?); shm:// needs it");
  }
  absl::StatusOr<int> fd = ReceiveRegionFd(hs.fd_socket(), token);
  if (!fd.ok()) return fd.status();
  void* p = mmap(nullptr, hs.region_bytes(), PROT_READ | PROT_WRITE, MAP_SHARED, *fd, 0);
  close(*fd);
  if (p == MAP_FAILED) return absl::InternalError(absl::StrCat("mmap of the kv pool region: ", std::strerror(errno)));
  return std::make_unique<ShmDataPath>(static_cast<uint8_t*>(p), hs.region_bytes());
}

}  // namespace dd::kvpool
